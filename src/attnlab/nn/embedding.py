"""Token and position embeddings (the output layer tied to the token table), and patch
embeddings for images."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.core.errors import AttnlabError
from attnlab.nn.dropout import Dropout


def sinusoids(pos: Tensor, dim: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), cos for 2i+1: (T,) positions -> (T, dim)."""
    freq = torch.exp(torch.arange(0, dim, 2, device=pos.device) * (-math.log(10000.0) / dim))
    pe = torch.zeros(len(pos), dim, device=pos.device)
    pe[:, 0::2] = torch.sin(pos[:, None] * freq)
    pe[:, 1::2] = torch.cos(pos[:, None] * freq)
    return pe


def fourier_features(h: int, w: int, n_bands: int, max_freq: tuple[float, float], device=None) -> Tensor:
    """The Perceiver's (H * W, 2 + 4 * n_bands) features of an H x W grid, row-major: the coordinates
    x_d in [-1, 1], sin(pi f_k x_d) and cos(pi f_k x_d), f_k linear from 1 to ``max_freq[d]`` (Nyquist)."""
    axes = [torch.linspace(-1.0, 1.0, n, device=device) for n in (h, w)]
    pos = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(h * w, 2)  # (M, 2)
    freqs = torch.stack([torch.linspace(1.0, f, n_bands, device=device) for f in max_freq])  # (2, K)
    angles = math.pi * (pos[:, :, None] * freqs).reshape(h * w, 2 * n_bands)  # (M, 2K)
    return torch.cat([pos, angles.sin(), angles.cos()], dim=-1)


class SinusoidalPositions(nn.Module):
    """Fixed sin/cos position encodings (Vaswani et al. 2017), kept for the first ``max_len``
    positions and computed past them."""

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__()
        self.register_buffer("pe", sinusoids(torch.arange(max_len), dim), persistent=False)
        self.dim, self.max_len = dim, max_len

    def forward(self, t: int, start: int = 0) -> Tensor:
        if start + t <= self.max_len:
            return self.pe[start : start + t]  # (T, C)
        return sinusoids(torch.arange(start, start + t, device=self.pe.device), self.dim)


class PastTheTable(AttnlabError, ValueError):
    """A sequence longer than a position table: an input error (``attnlab-eval`` names ``data.max_len``)."""


class LearnedPositions(nn.Module):
    """One learned vector per position (GPT, BERT, ViT); there are none past ``max_len``."""

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(max_len, dim)
        self.max_len = max_len

    def forward(self, t: int, start: int = 0) -> Tensor:
        if start + t > self.max_len:
            raise PastTheTable(
                f"a sequence of {start + t} tokens exceeds the {self.max_len} learned positions "
                "(max_len): learned positions stop at their table; sinusoidal, rope, alibi, t5 or "
                "none go past it"
            )
        return self.emb(torch.arange(start, start + t, device=self.emb.weight.device))  # (T, C)


class TokenEmbedding(nn.Module):
    """Token ids -> vectors (times sqrt(dim) with ``scale``), plus absolute ``positions``, then
    dropout; ``unembed`` maps states back to logits through the same table (tied, Press & Wolf 2017)."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        positions: nn.Module | None = None,
        dropout: float = 0.0,
        scale: bool = False,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim, padding_idx=padding_idx)
        self.positions = positions
        self.drop = Dropout(dropout)
        self.scale = math.sqrt(dim) if scale else 1.0

    @property
    def weight(self) -> Tensor:
        return self.tokens.weight

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        """(B, T) ids at positions start..start+T-1 -> (B, T, C)."""
        x = self.tokens(ids) * self.scale if self.scale != 1.0 else self.tokens(ids)
        if self.positions is not None:
            x = x + self.positions(ids.size(1), start)
        return self.drop(x)

    def unembed(self, x: Tensor) -> Tensor:
        return F.linear(x, self.tokens.weight)


class _ImageTokens(nn.Module):
    """(B, C, H, W) images -> (B, N, D) tokens, row by row, N = (img_size / patch_size)^2."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int) -> None:
        super().__init__()
        if img_size % patch_size != 0:
            raise ValueError(f"img_size: must be divisible by patch_size ({patch_size}), got {img_size}")
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2

    def forward(self, x: Tensor) -> Tensor:
        c, h, w = x.shape[1:]
        if (c, h, w) != (self.in_chans, self.img_size, self.img_size):
            raise ValueError(
                f"expected images of shape ({self.in_chans}, {self.img_size}, {self.img_size}), "
                f"got ({c}, {h}, {w})"
            )
        return self.norm(self.proj(self.convs(x)).flatten(2).transpose(1, 2))  # (B, N, D)


class PatchEmbedding(_ImageTokens):
    """An image cut into non-overlapping ``patch_size`` squares, each projected to ``dim``
    (Dosovitskiy et al. 2020): a strided convolution, then an optional norm (Swin's)."""

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        dim: int,
        norm_layer: Callable[[int], nn.Module] | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(img_size, patch_size, in_chans)
        self.convs = nn.Identity()  # no stem: the strided projection alone
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size, bias=bias)
        self.norm = norm_layer(dim) if norm_layer else nn.Identity()


class ConvStem(_ImageTokens):
    """ViT's "hybrid" input (Dosovitskiy et al. 2020, 3.1) as in Xiao et al. 2021: per halving of the
    resolution a stride-2 and a stride-1 3x3 conv-BN-ReLU, then a 1x1 projection to ``dim``; much
    faster learning on small data. The stages widen from ``dim / patch_size`` channels (at least 8).
    ``full_resolution``: first a conv-BN-ReLU at the image's own resolution (fine detail before the
    first stride, about a third more compute in ``vit_mini``)."""

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        dim: int,
        norm_layer: Callable[[int], nn.Module] | None = None,
        full_resolution: bool = False,
    ) -> None:
        super().__init__(img_size, patch_size, in_chans)
        if patch_size < 2 or patch_size & (patch_size - 1):
            raise ValueError(f"patch_size: must be a power of two >= 2 for a conv stem, got {patch_size}")
        layers = []
        chans, width = in_chans, max(dim // patch_size, 8)
        if full_resolution:
            layers.append(conv_bn_relu(in_chans, width))
            chans, width = width, width * 2
        for _ in range(patch_size.bit_length() - 1):  # log2(patch_size) halvings
            layers += [conv_bn_relu(chans, width, stride=2), conv_bn_relu(width, width)]
            chans, width = width, width * 2
        self.convs = nn.Sequential(*layers)
        self.proj = nn.Conv2d(chans, dim, kernel_size=1)
        self.norm = norm_layer(dim) if norm_layer else nn.Identity()


Stem = Literal["patch", "conv", "conv_full"]


def patch_embedding(
    stem: Stem,
    img_size: int,
    patch_size: int,
    in_chans: int,
    dim: int,
    norm_layer: Callable[[int], nn.Module] | None = None,
    bias: bool = True,
) -> nn.Module:
    """The image-to-tokens layer a net's ``stem`` names; ``bias=False``: a patch projection without
    bias (CLIP's)."""
    if stem == "patch":
        return PatchEmbedding(img_size, patch_size, in_chans, dim, norm_layer, bias)
    if not bias:
        raise ValueError("patch_bias: false is for stem=patch (a conv stem's layers keep theirs)")
    return ConvStem(img_size, patch_size, in_chans, dim, norm_layer, full_resolution=stem == "conv_full")


def conv_bn_relu(in_chans: int, out_chans: int, stride: int = 1) -> nn.Sequential:
    conv = nn.Conv2d(in_chans, out_chans, 3, stride=stride, padding=1, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(out_chans), nn.ReLU(inplace=True))
