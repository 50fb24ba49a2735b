"""The Perceiver (Jaegle et al. 2021): a learned latent array (N x D) cross-attends to every pixel
with Fourier features of its place (the "byte array", M = H * W rows, N << M), then a tower of
latent self-attention refines it; both repeat with shared weights (the first cross-attention has
its own, as in the paper). Only the cross-attention sees all M inputs, at a cost linear in M."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Unpack

import torch
import torch.nn.functional as F
from annotated_types import Ge
from timm.layers import DropPath
from torch import Tensor, nn

from attnlab.core.specs import DropRate, PositiveFloat, PositiveInt
from attnlab.models.vision.vit import ImageClassifier, drop_path_rates, grid_centres, init_linear
from attnlab.nn import (
    MLP,
    Dropout,
    KVCache,
    MultiHeadAttention,
    TransformerBlock,
    flops,
    fourier_features,
    health,
)
from attnlab.nn.attention import AttentionSpec, attention_layer
from attnlab.nn.flops import Flops, Grad


class CrossAttentionBlock(nn.Module):
    """The latents attend to the inputs, then an MLP; each a pre-LN residual branch."""

    def __init__(
        self,
        in_dim: int,
        dim: int,
        n_head: int,
        mlp_dim: int,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        attn_layer: Callable[..., MultiHeadAttention] = MultiHeadAttention,
    ) -> None:
        super().__init__()
        self.norm_inputs = nn.LayerNorm(in_dim)
        self.norm1 = nn.LayerNorm(dim)
        # keys and values straight from the byte array's C' channels, as the paper projects them:
        # one linear map, not two in a row (whose product learns slowly from a small init)
        self.attn = attn_layer(dim, n_head, kv_dim=in_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_dim)
        self.drop = Dropout(dropout)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def memory(self, inputs: Tensor) -> KVCache | Tensor:
        """The keys and values (B, heads, M, D / heads) of a byte array (B, M, C'), once for every
        repeat; while attention is recorded (never with a cache), the normalised byte array."""
        inputs = self.norm_inputs(inputs)
        return inputs if health.is_recording() else KVCache.of_memory(self.attn, inputs)

    def forward(
        self, latents: Tensor, memory: KVCache | Tensor, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """latents (B, N, D) -> (B, N, D), and the weights (B, H, N, M) when ``need_weights``."""
        kv, cache = (None, memory) if isinstance(memory, KVCache) else (memory, None)
        y, weights = self.attn(self.norm1(latents), kv, cache=cache, need_weights=need_weights)
        latents = latents + self.drop_path(self.drop(y))
        latents = latents + self.drop_path(self.drop(self.mlp(self.norm2(latents))))
        return latents, weights


class Perceiver(ImageClassifier):
    """Perceiver classifier from raw pixels (docs/perceiver.md). ``img_size``: the side whose
    Nyquist frequency the Fourier bands reach; other sizes run through the same weights. ``depth``
    latent blocks follow each of ``repeats`` cross-attentions. ``neighbourhood``: the odd side k of
    the pixels each element holds (1, the paper's: the pixel alone)."""

    def __init__(
        self,
        num_classes: PositiveInt,
        img_size: Annotated[int, Ge(2)],  # a Nyquist frequency >= 1
        in_chans: PositiveInt,
        n_latents: PositiveInt = 32,
        dim: PositiveInt = 128,
        depth: PositiveInt = 2,
        repeats: PositiveInt = 3,
        n_head: PositiveInt = 4,
        cross_heads: PositiveInt = 1,
        n_bands: PositiveInt = 8,
        neighbourhood: PositiveInt = 1,
        mlp_ratio: PositiveFloat = 2.0,
        dropout: DropRate = 0.0,
        drop_path: DropRate = 0.0,
        **attn: Unpack[AttentionSpec],
    ) -> None:
        super().__init__()
        if neighbourhood % 2 == 0:
            raise ValueError(f"neighbourhood: must be odd (centred on its pixel), got {neighbourhood}")
        if dim % cross_heads:
            raise ValueError(f"cross_heads: must divide dim ({dim}), got {cross_heads}")
        self.num_classes, self.img_size, self.in_chans = num_classes, img_size, in_chans
        self.n_bands, self.repeats, self.neighbourhood = n_bands, repeats, neighbourhood
        mlp_dim = int(dim * mlp_ratio)
        self.latents = nn.Parameter(torch.zeros(n_latents, dim))
        rates = iter(drop_path_rates(drop_path, depth + 1))
        attn_layer = attention_layer(**attn)
        in_dim = in_chans * neighbourhood**2 + 2 + 4 * n_bands  # each element's pixels and places
        cross = partial(
            CrossAttentionBlock, in_dim, dim, cross_heads, mlp_dim, dropout=dropout, attn_layer=attn_layer
        )
        self.cross_first = cross(drop_path=next(rates))
        self.cross = cross() if repeats > 1 else None  # every later repeat's
        block = partial(TransformerBlock, dim, n_head, mlp_dim, dropout=dropout, attn_layer=attn_layer)
        self.blocks = nn.ModuleList(block(drop_path=rate) for rate in rates)  # shared by every repeat
        health.give_positions(self.blocks, grid_centres(0, 0, prefix=n_latents))  # latents have no place
        self.norm = nn.LayerNorm(dim)
        self.num_features = dim
        self.head = nn.Linear(dim, num_classes)
        self.apply(init_linear)
        nn.init.trunc_normal_(self.latents, std=0.02)

    def no_weight_decay(self) -> set[str]:
        return {"latents"}

    def byte_array(self, images: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, H * W, C k^2 + 2 + 4K): the values of each pixel's k x k
        neighbourhood (channel-major) and its position features."""
        b, _, h, w = images.shape
        nyquist = (self.img_size / 2, self.img_size / 2)
        pos = fourier_features(h, w, self.n_bands, nyquist, images.device).to(images.dtype)
        k = self.neighbourhood
        pixels = F.unfold(images, k, padding=k // 2) if k > 1 else images.flatten(2)  # (B, C k^2, M)
        pixels = pixels.transpose(1, 2)  # (B, M, C k^2), row-major as the positions
        return torch.cat([pixels, pos.expand(b, -1, -1)], dim=-1)

    def encode(self, inputs: Tensor, need_weights: bool = False) -> tuple[Tensor, list[Tensor]]:
        """A byte array (B, M, C') in any order (positions travel in the features) -> normalised
        latents (B, N, D), and with ``need_weights`` each repeat's cross-attention (B, heads, N, M)."""
        latents = self.latents.expand(inputs.size(0), -1, -1)  # (B, N, D)
        maps = []
        for r in range(self.repeats):
            cross = self.cross_first if r == 0 else self.cross
            if r <= 1:  # the shared cross-attention projects the inputs once for all its repeats
                memory = cross.memory(inputs)
            latents, weights = cross(latents, memory, need_weights)
            maps.append(weights)
            for block in self.blocks:
                latents, _ = block(latents)
        return self.norm(latents), maps if need_weights else []

    def forward_features(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> normalised latents (B, N, D)."""
        if health.is_recording():  # the inputs' places in pixels; the latents have none
            for cross in filter(None, (self.cross_first, self.cross)):
                health.give_positions(
                    cross, grid_centres(0, 0, prefix=len(self.latents)), grid_centres(*images.shape[-2:])
                )
        return self.encode(self.byte_array(images))[0]

    def flops(self, images: Tensor, grad: Grad = "all", head: bool = True) -> Flops:
        """Model FLOPs of a training step on ``images`` (B, C, H, W) (``attnlab.nn.flops``): the
        pixels' keys and values projected once per cross-attention block, not per repeat."""
        b, m = images.size(0), images.size(-2) * images.size(-1)
        n = self.latents.size(0)
        f = flops.NONE
        for r in range(self.repeats):
            cross = self.cross_first if r == 0 else self.cross
            if r <= 1:
                f = f + flops.linear_layer(cross.attn.kv_proj, b * m, grad)
            f = f + flops.cross_attention(cross.attn, b, n, m, grad, project_memory=False)
            f = f + flops.mlp(cross.mlp, b * n, grad) + flops.blocks(self.blocks, b, n, grad)
        return f + self.head_flops(b, grad) if head else f

    @torch.no_grad()
    def patch_attention(self, images: Tensor) -> dict[str, Tensor]:
        """Where the latents look: the cross-attention weights summed over latents and heads,
        each map (B, H, W), of the first and the last repeat."""
        _, maps = self.encode(self.byte_array(images), need_weights=True)
        h, w = images.shape[-2:]
        pictures = {"cross-attention 1": maps[0]}
        if self.repeats > 1:
            pictures[f"cross-attention {self.repeats}"] = maps[-1]
        return {k: m.sum((1, 2)).reshape(-1, h, w) for k, m in pictures.items()}
