"""Swin Transformer (Liu et al. 2021): attention inside local windows that shift between blocks,
and patch merging between stages, which halves the map and doubles the width. Laid out as timm's
``swin_*`` models for their weights."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor, nn

from attnlab.core.specs import DropRate, NonNegativeInt, PositiveFloat, PositiveInt
from attnlab.models.vision.vit import ImageClassifier, drop_path_rates, grid_centres, init_linear
from attnlab.nn import Stem, TransformerBlock, flops, health, patch_embedding
from attnlab.nn.attention import AttentionImpl
from attnlab.nn.flops import Flops, Grad
from attnlab.nn.window_attention import WindowAttention, window_reverse


class PatchMerging(nn.Module):
    """(B, S * S, C) -> (B, S/2 * S/2, out_dim): each 2 x 2 group of tokens concatenated (4C),
    normalised and projected."""

    def __init__(self, dim: int, out_dim: int, size: int) -> None:
        super().__init__()
        self.size = size
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, out_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, _, c = x.shape
        x = x.view(b, self.size, self.size, c)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.view(b, -1, 4 * c)))  # (B, S/2 * S/2, out_dim)


class SwinStage(nn.Module):
    """Patch merging (all stages but the first), then blocks whose windows shift every other block;
    a map no larger than the window is one window, which cannot shift (as in the paper and timm)."""

    def __init__(
        self,
        dim: int,
        out_dim: int,
        size: int,
        depth: int,
        n_head: int,
        window: int,
        mlp_ratio: float,
        drop_path: Sequence[float],
        downsample: bool,
        dropout: float,
        attn_layer: Callable[..., WindowAttention],
    ) -> None:
        super().__init__()
        self.downsample = PatchMerging(dim, out_dim, size) if downsample else nn.Identity()
        self.size = size // 2 if downsample else size
        window = min(window, self.size)
        shift = window // 2 if self.size > window else 0
        self.blocks = nn.ModuleList(
            TransformerBlock(
                out_dim,
                n_head,
                int(out_dim * mlp_ratio),
                dropout=dropout,
                drop_path=drop_path[i],
                attn_layer=partial(attn_layer, size=self.size, window=window, shift=shift if i % 2 else 0),
            )
            for i in range(depth)
        )

    def forward(self, x: Tensor, need_weights: bool = False) -> tuple[Tensor, list[Tensor]]:
        x = self.downsample(x)
        maps = []
        for block in self.blocks:
            x, weights = block(x, need_weights=need_weights)
            maps.append(weights.self_attn)
        return x, maps


class SwinTransformer(ImageClassifier):
    """Swin classifier; ``dim`` is the first stage's width, doubled at each later one, and
    ``window_size`` must divide every stage's map (or exceed it: the map is then one window)."""

    def __init__(
        self,
        num_classes: NonNegativeInt,
        img_size: PositiveInt,
        in_chans: PositiveInt,
        patch_size: PositiveInt = 4,
        dim: PositiveInt = 96,
        depths: Sequence[PositiveInt] = (2, 2, 6, 2),
        n_head: Sequence[PositiveInt] = (3, 6, 12, 24),
        window_size: PositiveInt = 7,
        mlp_ratio: PositiveFloat = 4.0,
        dropout: DropRate = 0.0,
        attn_dropout: DropRate = 0.0,
        drop_path: DropRate = 0.1,
        attn_impl: AttentionImpl = "auto",
        stem: Stem = "patch",
    ) -> None:
        super().__init__()
        if len(n_head) != len(depths):
            raise ValueError(f"n_head: one entry per stage of depths ({len(depths)}), got {len(n_head)}")
        for i, heads in enumerate(n_head):
            if (dim * 2**i) % heads:
                raise ValueError(
                    f"n_head: stage {i + 1}'s width {dim * 2**i} is not divisible by its {heads} heads"
                )
        self.num_classes, self.img_size, self.in_chans = num_classes, img_size, in_chans
        self.patch_embed = patch_embedding(stem, img_size, patch_size, in_chans, dim, nn.LayerNorm)
        sizes = self._stage_sizes(self.patch_embed.grid_size, len(depths), window_size)
        rates = iter(drop_path_rates(drop_path, sum(depths)))
        self.layers = nn.ModuleList(
            SwinStage(
                dim * 2 ** max(i - 1, 0),  # stage i > 0 starts by merging patches: width doubles
                dim * 2**i,
                sizes[i - 1] if i else sizes[0],
                depth,
                heads,
                window_size,
                mlp_ratio,
                [next(rates) for _ in range(depth)],
                downsample=i > 0,
                dropout=dropout,
                attn_layer=partial(WindowAttention, dropout=attn_dropout, impl=attn_impl),
            )
            for i, (depth, heads) in enumerate(zip(depths, n_head, strict=True))
        )
        for stage in self.layers:  # a window's tokens, in pixels, for attention distances
            w = stage.blocks[0].attn.window
            health.give_positions(stage.blocks, grid_centres(w, w, img_size / stage.size))
        out_dim = dim * 2 ** (len(depths) - 1)
        self.norm = nn.LayerNorm(out_dim)
        self.num_features = out_dim  # what forward_head(pre_logits=True) returns, as in timm
        self.head = nn.Linear(out_dim, num_classes) if num_classes else nn.Identity()
        self.apply(init_linear)

    @staticmethod
    def _stage_sizes(grid: int, n_stages: int, window: int) -> list[int]:
        """Side of each stage's map; every one must split into whole windows."""
        sizes = [grid]
        for i in range(1, n_stages):
            if sizes[-1] % 2:
                raise ValueError(
                    f"img_size: stage {i + 1} merges 2x2 patches but stage {i}'s map is "
                    f"{sizes[-1]}x{sizes[-1]} tokens; choose img_size / patch_size divisible "
                    f"by {2 ** (n_stages - 1)}"
                )
            sizes.append(sizes[-1] // 2)
        for i, size in enumerate(sizes):
            if size > window and size % window:
                raise ValueError(
                    f"window_size: must divide the feature map of stage {i + 1} ({size}x{size} "
                    f"tokens), got {window}; choose a window size dividing {size}"
                )
        return sizes

    def forward_features(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> normalised token states of the last stage (B, S * S, D)."""
        x = self.patch_embed(images)
        for stage in self.layers:
            x, _ = stage(x)
        return self.norm(x)

    def flops(self, images: Tensor, grad: Grad = "all", head: bool = True) -> Flops:
        """Model FLOPs of a training step on ``images`` (B, C, H, W) (``attnlab.nn.flops``)."""
        b = images.size(0)
        f, _ = flops.convs(self.patch_embed, b, self.img_size, grad)
        for stage in self.layers:
            if isinstance(stage.downsample, PatchMerging):
                f = f + flops.linear_layer(stage.downsample.reduction, b * stage.size**2, grad)
            f = f + flops.blocks(stage.blocks, b, stage.size**2, grad)
        return f + self.head_flops(b, grad) if head else f

    @torch.no_grad()
    def attention_maps(self, images: Tensor) -> list[Tensor]:
        """Every block's per-window attention weights (B * nW, H, N, N), first block first."""
        x = self.patch_embed(images)
        maps = []
        for stage in self.layers:
            x, weights = stage(x, need_weights=True)
            maps += weights
        return maps

    @torch.no_grad()
    def patch_attention(self, images: Tensor) -> dict[str, Tensor]:
        """How much attention each patch gets in the first stage's blocks, averaged over the heads
        and the queries of its window: maps (B, grid, grid)."""
        maps, stage = self.attention_maps(images), self.layers[0]
        out = {}
        for i, (block, weights) in enumerate(zip(stage.blocks, maps, strict=False)):
            attn = block.attn
            received = weights.mean(dim=(1, 2))[..., None]  # (B * nW, N, 1)
            grid = window_reverse(received, attn.window, attn.size, attn.size)[..., 0]  # (B, S, S), shifted
            grid = torch.roll(grid, shifts=(attn.shift, attn.shift), dims=(1, 2))
            out[f"{'shifted ' if attn.shift else ''}windows, block {i + 1}"] = grid
        return out
