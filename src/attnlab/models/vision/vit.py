"""ViT (Dosovitskiy et al. 2020) and DeiT's distilled ViT (Touvron et al. 2021), laid out as
timm's ``vit_*`` and ``deit_*distilled*`` models for their weights."""

from __future__ import annotations

from functools import partial
from typing import Literal, Unpack

import torch
from torch import Tensor, nn

from attnlab.core.specs import DropRate, NonNegativeInt, PositiveFloat, PositiveInt
from attnlab.nn import Dropout, Stem, TransformerBlock, flops, health, patch_embedding
from attnlab.nn.attention import AttentionSpec, attention_layer
from attnlab.nn.blocks import Activation, activation
from attnlab.nn.flops import Flops, Grad


def grid_centres(rows: int, cols: int, pixels: float = 1.0, prefix: int = 0) -> Tensor:
    """(prefix + rows * cols, 2): the centres (row, col) in pixels of a row-major grid of cells
    ``pixels`` wide, behind ``prefix`` NaN rows (tokens with no place: [CLS], a latent)."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    centres = (torch.stack([r, c], -1).reshape(-1, 2) + 0.5) * pixels
    return torch.cat([torch.full((prefix, 2), float("nan")), centres])


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Stochastic depth rising linearly from 0 at the first block to ``rate`` at the last."""
    return torch.linspace(0.0, rate, depth).tolist()


class ImageClassifier(nn.Module):
    """timm's split of a classifier (the ``ImageBackbone`` contract): ``forward_features``, then
    ``forward_head`` on the mean token; ``head`` a Linear layer, or Identity without classes."""

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Token states (B, T, D) -> logits (B, num_classes), or the pooled (B, D) features."""
        x = x.mean(1)
        return x if pre_logits else self.head(x)

    def forward(self, images: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(images))

    def head_flops(self, b: int, grad: Grad = "all") -> Flops:
        return flops.linear_layer(self.head, b, grad) if isinstance(self.head, nn.Linear) else flops.NONE


class VisionTransformer(ImageClassifier):
    """ViT classifier; ``num_classes=0`` leaves out the head (a backbone), as in timm.
    ``pre_norm``, ``patch_bias``, ``act``: CLIP's image tower (open_clip, timm's ``vit_*_clip_*``):
    a LayerNorm before the blocks and with it every eps CLIP's 1e-5 (else timm's 1e-6)."""

    num_prefix_tokens = 1  # [CLS]

    def __init__(
        self,
        num_classes: NonNegativeInt,
        img_size: PositiveInt,
        in_chans: PositiveInt,
        patch_size: PositiveInt = 4,
        dim: PositiveInt = 192,
        depth: PositiveInt = 12,
        n_head: PositiveInt = 3,
        mlp_ratio: PositiveFloat = 4.0,
        dropout: DropRate = 0.0,
        drop_path: DropRate = 0.0,
        stem: Stem = "patch",
        pre_norm: bool = False,
        patch_bias: bool = True,
        act: Activation = "gelu",
        global_pool: Literal["token", "avg"] = "token",
        **attn: Unpack[AttentionSpec],
    ) -> None:
        super().__init__()
        self.num_classes, self.img_size, self.in_chans = num_classes, img_size, in_chans
        self.global_pool = global_pool
        self.patch_embed = patch_embedding(stem, img_size, patch_size, in_chans, dim, bias=patch_bias)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        n_tokens = self.num_prefix_tokens + self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, n_tokens, dim))
        self.pos_drop = Dropout(dropout)
        norm_layer = partial(nn.LayerNorm, eps=1e-5 if pre_norm else 1e-6)
        self.norm_pre = norm_layer(dim) if pre_norm else nn.Identity()
        block = partial(
            TransformerBlock,
            dim,
            n_head,
            int(dim * mlp_ratio),
            dropout=dropout,
            attn_layer=attention_layer(**attn),
            norm_layer=norm_layer,
            act_layer=activation(act),
        )
        self.blocks = nn.ModuleList(block(drop_path=rate) for rate in drop_path_rates(drop_path, depth))
        g = self.patch_embed.grid_size
        health.give_positions(self.blocks, grid_centres(g, g, img_size / g, self.num_prefix_tokens))
        self.norm = norm_layer(dim)
        self.num_features = dim  # what forward_head(pre_logits=True) returns, as in timm
        self.head = nn.Linear(dim, num_classes) if num_classes else nn.Identity()
        self.add_extras(dim, num_classes)
        self.apply(init_linear)
        for name, p in self.named_parameters():
            if name in self.no_weight_decay():  # the position table and the prefix tokens
                nn.init.trunc_normal_(p, std=0.02)

    def add_extras(self, dim: int, num_classes: int) -> None:
        """Parameters a variant adds (DeiT: the distillation token and its head)."""

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    def prefix_tokens(self, b: int) -> Tensor:
        return self.cls_token.expand(b, -1, -1)  # (B, 1, D)

    def tokens(self, images: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, T, D): prefix tokens and patches, with positions."""
        x = self.patch_embed(images)  # (B, N, D)
        x = torch.cat([self.prefix_tokens(x.size(0)), x], dim=1) + self.pos_embed
        return self.norm_pre(self.pos_drop(x))

    def forward_features(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> normalised token states (B, T, D)."""
        x = self.tokens(images)
        for block in self.blocks:
            x, _ = block(x)
        return self.norm(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = x[:, self.num_prefix_tokens :].mean(1) if self.global_pool == "avg" else x[:, 0]
        return x if pre_logits else self.head(x)

    def flops(self, images: Tensor, grad: Grad = "all", head: bool = True) -> Flops:
        """Model FLOPs of a training step on ``images`` (B, C, H, W) (``attnlab.nn.flops``)."""
        b = images.size(0)
        f, _ = flops.convs(self.patch_embed, b, self.img_size, grad)
        f = f + flops.blocks(self.blocks, b, self.pos_embed.size(1), grad)
        return f + self.head_flops(b, grad) if head else f

    @torch.no_grad()
    def attention_maps(self, images: Tensor) -> list[Tensor]:
        """Every block's attention weights (B, H, T, T), first block first."""
        x = self.tokens(images)
        maps = []
        for block in self.blocks:
            x, weights = block(x, need_weights=True)
            maps.append(weights.self_attn)
        return maps

    @torch.no_grad()
    def patch_attention(self, images: Tensor) -> dict[str, Tensor]:
        """How much attention each patch gets from [CLS], each map (B, grid, grid): in the last
        block (mean over heads), and through all blocks by attention rollout."""
        maps = self.attention_maps(images)
        p, g = self.num_prefix_tokens, self.patch_embed.grid_size
        last = maps[-1].mean(1)[:, 0, p:]
        rollout = attention_rollout(maps)[:, 0, p:]
        return {"[CLS], last block": last.reshape(-1, g, g), "rollout": rollout.reshape(-1, g, g)}


def attention_rollout(maps: list[Tensor]) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020): per block the head-averaged weights plus the
    identity (the residual path), rows renormalised, multiplied through the blocks: (B, T, T)."""
    rollout = None
    for weights in maps:  # (B, H, T, T)
        a = weights.mean(1) + torch.eye(weights.size(-1), device=weights.device)
        a = a / a.sum(-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout
    return rollout


class DistilledVisionTransformer(VisionTransformer):
    """DeiT: a ViT with a second, distillation token whose head learns from a teacher's
    predictions; at inference the two heads' logits are averaged."""

    num_prefix_tokens = 2  # [CLS], [DIST]

    def add_extras(self, dim: int, num_classes: int) -> None:
        if self.global_pool != "token":
            raise ValueError("global_pool: DeiT's heads read its two tokens: use token")
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.head_dist = nn.Linear(dim, num_classes)

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"dist_token"}

    def prefix_tokens(self, b: int) -> Tensor:
        return torch.cat([self.cls_token, self.dist_token], dim=1).expand(b, -1, -1)  # (B, 2, D)

    def forward_heads(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """Logits of the class head and of the distillation head, each (B, num_classes)."""
        x = self.forward_features(images)
        return self.head(x[:, 0]), self.head_dist(x[:, 1])

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if pre_logits:
            return (x[:, 0] + x[:, 1]) / 2
        return (self.head(x[:, 0]) + self.head_dist(x[:, 1])) / 2

    def head_flops(self, b: int, grad: Grad = "all") -> Flops:
        return super().head_flops(b, grad) + flops.linear_layer(self.head_dist, b, grad)


def init_linear(module: nn.Module) -> None:
    """Linear layers: truncated normal weights (std 0.02), zero biases, as timm's ViT and Swin."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
