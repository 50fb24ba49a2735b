"""Flamingo (Alayrac et al. 2022): a frozen vision encoder and a frozen ``GPT`` joined by a
trained Perceiver Resampler and gated cross-attention. In interleaved sequences, images
(B, N, C, H, W) and tokens (B, T), a token attends only to the latents of the last image marked
(``image_token``) at or before it, as in the paper; one image (B, C, H, W) is seen by every token.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.core.errors import DataError
from attnlab.core.specs import NonNegativeInt, PositiveFloat, PositiveInt, nested
from attnlab.models.text.gpt import GPT, Cache
from attnlab.models.vision.convnet import ConvNet
from attnlab.models.vision.vit import VisionTransformer, grid_centres
from attnlab.nn import MLP, KVCache, MultiHeadAttention, flops, fourier_features, health
from attnlab.nn.flops import Flops

log = logging.getLogger(__name__)

VisionEncoder = ConvNet | VisionTransformer  # what the resampler can read (``Flamingo.features``)


class ResamplerLayer(nn.Module):
    """Latents attend to [features; latents] (keys and values from both), then an MLP."""

    def __init__(self, dim: int, n_head: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm_media = nn.LayerNorm(dim)
        self.norm_latents = nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, n_head)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(mlp_ratio * dim))

    def forward(self, latents: Tensor, media: Tensor, need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """latents (B, L, D), media (B, S, D) -> latents (B, L, D), weights (B, H, L, S + L)."""
        q = self.norm_latents(latents)
        kv = torch.cat([self.norm_media(media), q], dim=1)  # (B, S + L, D)
        y, weights = self.attn(q, kv, need_weights=need_weights)
        latents = latents + y
        return latents + self.mlp(self.norm2(latents)), weights


class PerceiverResampler(nn.Module):
    """Image features (B, S, in_dim) on a row-major grid of S = grid x grid cells, each with
    Fourier features of its place (why: docs/captioning.md) -> ``n_latents`` vectors (B, L, dim).
    With ``region_latents`` (not the paper's) latent i starts at its learned vector plus the mean
    of region i of an r x r split of the grid."""

    def __init__(
        self,
        in_dim: int,
        dim: int,
        grid: int,
        depth: int = 2,
        n_head: int = 4,
        n_latents: int = 16,
        mlp_ratio: float = 2.0,
        n_bands: int = 4,
        region_latents: bool = False,
    ) -> None:
        super().__init__()
        if region_latents and math.isqrt(n_latents) ** 2 != n_latents:
            raise ValueError(
                f"n_latents: region_latents needs a square (one latent per region), got {n_latents}"
            )
        self.grid, self.region_latents = grid, region_latents
        places = fourier_features(grid, grid, n_bands, (grid / 2, grid / 2))  # (S, 2 + 4 * n_bands)
        self.register_buffer("places", places, persistent=False)
        self.proj = nn.Linear(in_dim + places.size(1), dim)
        self.latents = nn.Parameter(torch.randn(n_latents, dim) * 0.02)
        self.layers = nn.ModuleList(ResamplerLayer(dim, n_head, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def region_means(self, media: Tensor) -> Tensor:
        """media (B, S, dim) on the grid -> the mean of each of r x r = L regions (B, L, dim)."""
        cells = media.transpose(1, 2).unflatten(2, (self.grid, self.grid))  # (B, dim, grid, grid)
        return F.adaptive_avg_pool2d(cells, math.isqrt(len(self.latents))).flatten(2).transpose(1, 2)

    def forward(self, features: Tensor, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """features (B, S, in_dim) -> latents (B, L, dim) and, with ``need_weights``, where each
        latent looks (B, L, S): its attention to the features, renormalised, averaged over heads
        and layers."""
        if features.size(1) != len(self.places):
            raise DataError(
                f"the resampler was built for {len(self.places)} patches per image, got {features.size(1)}"
            )
        places = self.places.to(features.dtype).expand(features.size(0), -1, -1)
        media = self.proj(torch.cat([features, places], dim=-1))  # (B, S, dim)
        x = self.latents.expand(features.size(0), -1, -1)
        if self.region_latents:
            x = x + self.region_means(media)
        maps = []
        for layer in self.layers:
            x, weights = layer(x, media, need_weights)
            if need_weights:
                on_media = weights.mean(1)[..., : media.size(1)]  # (B, L, S)
                maps.append(on_media / on_media.sum(-1, keepdim=True))
        return self.norm(x), torch.stack(maps).mean(0) if need_weights else None


class GatedCrossAttentionBlock(nn.Module):
    """x + tanh(a) * attn(ln(x), latents), then x + tanh(b) * mlp(ln(x)), with a = b = 0 at first:
    the frozen language model is untouched until the gates open."""

    def __init__(self, dim: int, n_head: int, mlp_ratio: float = 2.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, n_head)
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(mlp_ratio * dim))
        self.mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(
        self,
        x: Tensor,
        latents: Tensor | None,
        visible: Tensor,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, D) over ``latents`` (B, K, D) (or their projection in ``cache``) where ``visible``
        (B, T, K); a token that sees none gets none -> x and the weights (B, H, T, K)."""
        if health.is_recording():  # the latents have no place: no attention distance
            health.give_positions(
                self.attn, grid_centres(0, 0, prefix=x.size(1)), grid_centres(0, 0, prefix=visible.size(-1))
            )
        sees_some = visible.any(-1, keepdim=True)  # (B, T, 1)
        mask = (visible | ~sees_some)[:, None]  # (B, 1, T, K): blind rows attend all, then zeroed
        y, weights = self.attn(self.norm1(x), latents, attn_mask=mask, cache=cache, need_weights=need_weights)
        y = y * sees_some
        if weights is not None:
            weights = weights * sees_some[:, None]
        x = x + self.attn_gate.tanh() * y
        return x + self.mlp_gate.tanh() * self.mlp(self.norm2(x)), weights


class FeatureCache:
    """The frozen encoder's features of up to ``size`` images seen before (0: off), keyed by the
    image's bytes and the autocast dtype; ``clear`` it when the encoder's weights change."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.store: dict[tuple[str, bytes], Tensor] = {}
        self.misses = 0  # images the last call encoded (``Flamingo.flops`` counts their FLOPs)

    def __call__(self, images: Tensor, encode: Callable[[Tensor], Tensor]) -> Tensor:
        """images (B, C, H, W) -> encode(images) (B, ...), the images seen before from the store."""
        if not self.size:
            self.misses = len(images)
            return encode(images)
        device = images.device.type
        context = str(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        keys = [
            (context, hashlib.blake2b(image.view(torch.uint8).numpy(), digest_size=16).digest())
            for image in images.detach().cpu().contiguous()
        ]
        missing = [i for i, key in enumerate(keys) if key not in self.store]
        self.misses = len(missing)
        fresh = dict(zip((keys[i] for i in missing), encode(images[missing]), strict=True)) if missing else {}
        out = torch.stack([self.store[key] if key in self.store else fresh[key] for key in keys])
        self.store.update(list(fresh.items())[: self.size - len(self.store)])
        return out

    def clear(self) -> None:
        self.store.clear()


@dataclass
class FlamingoState:
    """What decoding keeps between steps."""

    caches: list[Cache]  # the frozen GPT's
    cross: list[KVCache]  # each gated block's projection of the latents
    image: Tensor  # (B,) each row's current image, -1: none yet
    patch_attn: Tensor  # (B, N, L, S)
    interleaved: bool  # markers move a row to its next image (else its one image is seen)
    attn: Tensor | None = None  # the last step's attention over its image's patches (B, S)


class Flamingo(nn.Module):
    """A frozen vision encoder (``vision``: a convnet's last map, cell by cell, or a ViT's patch
    tokens) and a frozen ``GPT`` (``lm``), each loaded from a run of its own, joined by a trained
    ``PerceiverResampler`` and a ``GatedCrossAttentionBlock`` before every ``cross_every``-th GPT
    block. ``image_token`` (BOS: a caption is a chunk) marks an image."""

    def __init__(
        self,
        vision: Callable[..., VisionEncoder],
        lm: Callable[..., GPT],
        vocab_size: PositiveInt,
        img_size: PositiveInt,
        in_chans: PositiveInt,
        n_latents: PositiveInt = 16,
        resampler_depth: PositiveInt = 2,
        n_head: PositiveInt = 4,
        mlp_ratio: PositiveFloat = 2.0,
        place_bands: PositiveInt = 4,
        cross_every: PositiveInt = 1,
        image_token: int = 1,
        region_latents: bool = False,
        feature_cache: NonNegativeInt = 0,
    ) -> None:
        super().__init__()
        with nested("vision"):
            vision = vision(img_size=img_size, in_chans=in_chans)
        with nested("lm"):
            lm = lm(vocab_size=vocab_size)
        self.vision = vision.eval().requires_grad_(False)
        self.lm = lm.eval().requires_grad_(False)
        self.feature_cache = FeatureCache(feature_cache)
        self.register_load_state_dict_post_hook(Flamingo._forget_features)
        self.image_token, self.n_latents = image_token, n_latents
        dim = lm.norm.normalized_shape[0]
        if dim % n_head:
            raise ValueError(f"n_head: must divide the language model's width ({dim}), got {n_head}")
        with torch.no_grad():  # the encoder's grid of features, read off a blank image
            grid = math.isqrt(self.features(torch.zeros(1, in_chans, img_size, img_size)).size(1))
        settings = (resampler_depth, n_head, n_latents, mlp_ratio, place_bands, region_latents)
        self.resampler = PerceiverResampler(vision.num_features, dim, grid, *settings)
        # the latents attend to the cells' centres, in pixels, and to themselves, which have no place
        nowhere = grid_centres(0, 0, prefix=n_latents)
        cells = grid_centres(grid, grid, img_size / grid)
        health.give_positions(self.resampler.layers, nowhere, torch.cat([cells, nowhere]))
        self.cross_every = cross_every  # a gated block before every cross_every-th GPT block
        self.xattn = nn.ModuleList(
            GatedCrossAttentionBlock(dim, n_head, mlp_ratio) for _ in lm.blocks[::cross_every]
        )
        self.grid = (grid, grid)
        trained = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        log.info("Flamingo: %d of %d parameters trained (%.1f%%)", trained, total, 100 * trained / total)

    @staticmethod
    def _forget_features(net: Flamingo, _: object) -> None:
        """After new weights are loaded: the cached features are the old encoder's."""
        net.feature_cache.clear()

    def train(self, mode: bool = True) -> Flamingo:
        """The frozen encoder and LM stay in eval mode (no dropout) while the new layers train."""
        super().train(mode)
        self.vision.eval()
        self.lm.eval()
        return self

    def features(self, images: Tensor) -> Tensor:
        """images (B, C, H, W) -> the frozen encoder's features (B, S, Dv), row-major."""
        x = self.vision.forward_features(images)
        if x.dim() == 4:  # a convnet's map (B, Dv, h, w)
            return x.flatten(2).transpose(1, 2)
        return x[:, self.vision.num_prefix_tokens :]

    def encode(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """images (B, N, C, H, W) -> latents (B, N * L, D) and where they look (B, N, L, S)."""
        b, n = images.shape[:2]
        with torch.no_grad():
            features = self.feature_cache(images.flatten(0, 1), self.features)  # (B * N, S, Dv)
        latents, patch_attn = self.resampler(features, need_weights=True)
        return latents.reshape(b, -1, latents.size(-1)), patch_attn.unflatten(0, (b, n))

    def _decode(
        self,
        tokens: Tensor,
        image: Tensor,
        n_images: int,
        latents: Tensor | None = None,
        state: FlamingoState | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The GPT and gated blocks over ``tokens`` (B, T), each seeing ``image`` (B, T) (-1: none),
        given ``latents`` (B, N * L, D) or a decoding ``state`` -> logits (B, T, V) and the
        cross-attention (B, T, N * L), averaged over heads and gated blocks."""
        lm = self.lm
        key_image = torch.arange(n_images * self.n_latents, device=tokens.device) // self.n_latents
        visible = key_image == image[..., None]  # (B, T, N * L)
        x = lm.embed_input(tokens, state.caches[0].seen if state else 0)  # (B, T or 1 + T, D)
        n_start = x.size(1) - tokens.size(1)  # a NoPE GPT's start token, which sees no image
        visible = F.pad(visible, (0, 0, n_start, 0))
        weights = []
        for i, block in enumerate(lm.blocks):
            if i % self.cross_every == 0:
                j = i // self.cross_every  # the gated block before this one
                cross = state.cross[j] if state else None
                x, w = self.xattn[j](x, latents, visible, cache=cross, need_weights=True)
                weights.append(w.mean(1))
            cache = state.caches[i] if state else None
            x, _ = block(x, causal=True, cache=cache, positions=lm.positions)
        return lm.logits(x, tokens.size(1)), torch.stack(weights).mean(0)[:, n_start:]

    def image_of_tokens(self, tokens: Tensor, n_images: int, first: Tensor | None = None) -> Tensor:
        """The image each token (B, T) sees: markers counted up to it, minus one, after ``first``
        (B,) (the image the row was on before these tokens; default -1, none)."""
        image = (tokens == self.image_token).long().cumsum(1) + (-1 if first is None else first[:, None])
        if (image >= n_images).any():
            raise DataError(
                f"image_token: a sequence marks more images (token {self.image_token}) than "
                f"the {n_images} it was given"
            )
        return image

    @staticmethod
    def _as_sequence(images: Tensor) -> Tensor:
        return images[:, None] if images.dim() == 4 else images  # (B, N, C, H, W)

    @staticmethod
    def _on_patches(xattn: Tensor, patch_attn: Tensor) -> Tensor:
        """Cross-attention over latents (B, T, N * L) composed with where the latents look
        (B, N, L, S): each token's attention over its image's patches (B, T, S)."""
        b, n, n_latents, _ = patch_attn.shape
        return torch.einsum("btnl,bnls->bts", xattn.reshape(b, -1, n, n_latents), patch_attn)

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing: images (B, C, H, W) or (B, N, C, H, W) and tokens (B, T) -> logits
        (B, T, V) and each token's attention over the patches of the image it sees (B, T, S)."""
        interleaved = images.dim() == 5
        images = self._as_sequence(images)
        latents, patch_attn = self.encode(images)
        image = self.image_of_tokens(tokens, images.size(1)) if interleaved else torch.zeros_like(tokens)
        logits, xattn = self._decode(tokens, image, images.size(1), latents=latents)
        return logits, self._on_patches(xattn, patch_attn)

    def flops(self, images: Tensor, tokens: Tensor) -> Flops:
        """Model FLOPs of a training step (``attnlab.nn.flops``); the frozen encoder's only on the
        images the feature cache did not hold, so call it after the step."""
        images = self._as_sequence(images)
        (b, n), t = images.shape[:2], tokens.size(1)
        s = self.grid[0] * self.grid[1]
        latents = n * self.n_latents
        resampler = self.resampler
        frames = images.flatten(0, 1)
        encoded = self.feature_cache.misses if self.feature_cache.size else len(frames)
        f = self.vision.flops(frames[:encoded], grad="none", head=False)
        f = f + flops.linear_layer(resampler.proj, b * n * s, on_data=True)
        for layer in resampler.layers:  # the latents attend to [features; latents]
            f = f + flops.cross_attention(layer.attn, b * n, self.n_latents, s + self.n_latents)
            f = f + flops.mlp(layer.mlp, b * n * self.n_latents)
        t_in = t + (self.lm.start_token is not None)
        for block in self.xattn:
            f = f + flops.cross_attention(block.attn, b, t_in, latents) + flops.mlp(block.mlp, b * t_in)
        f = f + self.lm.flops(tokens, grad="input")
        return f + flops.product(b, t, latents, s, grad="none")

    def start(self, images: Tensor, prompt: Tensor | None = None) -> FlamingoState:
        """Encode the images (B, C, H, W) or (B, N, C, H, W) once; with a ``prompt`` (B, P) (a
        few-shot context), run it through the caches so that decoding continues after it."""
        interleaved = images.dim() == 5
        images = self._as_sequence(images)
        latents, patch_attn = self.encode(images)
        state = FlamingoState(
            caches=self.lm.new_caches(),
            cross=[KVCache.of_memory(block.attn, latents) for block in self.xattn],
            image=torch.full((images.size(0),), -1 if interleaved else 0, device=images.device),
            patch_attn=patch_attn,
            interleaved=interleaved,
        )
        if prompt is not None:
            image = self._advance(prompt, state)
            self._decode(prompt, image, images.size(1), state=state)
            state.image = image[:, -1]
        return state

    def _advance(self, tokens: Tensor, state: FlamingoState) -> Tensor:
        """The image each of ``tokens`` (B, T), which follow the state's, sees (B, T)."""
        if not state.interleaved:
            return state.image[:, None].expand_as(tokens)
        return self.image_of_tokens(tokens, state.patch_attn.size(1), state.image)

    def step(self, tokens: Tensor, state: FlamingoState) -> tuple[Tensor, FlamingoState]:
        """Tokens (B,) -> logits (B, V) and the state, its ``attn`` over the patches (B, S)."""
        image = self._advance(tokens[:, None], state)  # (B, 1)
        logits, xattn = self._decode(tokens[:, None], image, state.patch_attn.size(1), state=state)
        state.image = image[:, 0]
        state.attn = self._on_patches(xattn, state.patch_attn)[:, 0]
        return logits[:, 0], state

    def reorder(self, state: FlamingoState, index: Tensor) -> FlamingoState:
        for cache in [*state.caches, *state.cross]:
            cache.reorder(index)
        state.image, state.patch_attn = state.image[index], state.patch_attn[index]
        state.attn = None if state.attn is None else state.attn[index]
        return state


def few_shot_prompt(
    examples: list[tuple[Tensor, Tensor]], query: Tensor, pad_id: int = 0
) -> tuple[Tensor, Tensor]:
    """(image, caption) example pairs and a query image -> the images (k + 1, C, H, W) and the
    context tokens (P,): each example's caption tokens ([BOS] words [EOS], padding dropped) in
    order. Decoding then starts from BOS, the query image's marker."""
    if not examples:
        raise DataError("few-shot prompting needs at least one (image, caption) example")
    images = torch.stack([image for image, _ in examples] + [query])
    tokens = torch.cat([caption[caption != pad_id] for _, caption in examples])
    return images, tokens
