"""The Swin Transformer's attention (Liu et al. 2021): each token attends within its window of the
map, every other block shifted by half a window so information crosses window borders; a mask keeps
apart the tokens that wrapped around the map's edge."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnlab.nn.attention import AttentionImpl, MultiHeadAttention


def window_partition(x: Tensor, window: int) -> Tensor:
    """(B, H, W, C) -> (B * nW, window * window, C); windows row by row, image by image."""
    b, h, w, c = x.shape
    x = x.view(b, h // window, window, w // window, window, c).transpose(2, 3)  # (B, H/w, W/w, w, w, C)
    return x.reshape(-1, window * window, c)


def window_reverse(windows: Tensor, window: int, h: int, w: int) -> Tensor:
    """(B * nW, window * window, C) -> (B, H, W, C): the inverse of ``window_partition``."""
    c = windows.size(-1)
    x = windows.view(-1, h // window, w // window, window, window, c).transpose(2, 3)
    return x.reshape(-1, h, w, c)


def relative_position_index(window: int) -> Tensor:
    """(N, N) index, N = window^2: the offset (dy, dx) from token j to token i of a window, as a
    row of the (2 window - 1)^2 bias table."""
    grid = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
    coords = torch.stack(grid).flatten(1)  # (2, N)
    rel = coords[:, :, None] - coords[:, None, :] + (window - 1)  # (2, N, N), each in 0..2w-2
    return rel[0] * (2 * window - 1) + rel[1]


def shifted_window_mask(size: int, window: int, shift: int) -> Tensor:
    """Boolean (nW, N, N), True where two tokens of a window of the shifted map may attend to
    each other: they came from the same region of the map before the cyclic shift."""
    region = torch.zeros(size, size, dtype=torch.long)
    bands = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for i, rows in enumerate(bands):
        for j, cols in enumerate(bands):
            region[rows, cols] = 3 * i + j
    ids = window_partition(region[None, :, :, None], window).squeeze(-1)  # (nW, N)
    return ids[:, :, None] == ids[:, None, :]


class WindowAttention(MultiHeadAttention):
    """Self-attention within ``window`` x ``window`` windows of a ``size`` x ``size`` map of tokens,
    cyclically shifted by ``shift`` first, plus a learned bias per head and relative offset: a
    ``TransformerBlock``'s ``attn_layer``. Weights copy from timm's (``qkv``, ``proj``)."""

    def __init__(
        self,
        dim: int,
        n_head: int,
        size: int,
        window: int,
        shift: int = 0,
        dropout: float = 0.0,
        bias: bool = True,
        impl: AttentionImpl = "auto",
    ) -> None:
        super().__init__(dim, n_head, dropout=dropout, bias=bias, impl=impl)
        if size % window != 0 or not 0 <= shift < window:
            raise ValueError(
                f"window {window} must divide the map's side {size}, and 0 <= shift {shift} < window"
            )
        self.size, self.window, self.shift = size, window, shift
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, n_head))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", relative_position_index(window), persistent=False)
        mask = shifted_window_mask(size, window, shift) if shift else None
        self.register_buffer("shift_mask", mask, persistent=False)

    def no_weight_decay(self) -> set[str]:
        return {"relative_position_bias_table"}

    def relative_position_bias(self) -> Tensor:
        """(H, N, N): each head's bias on the score of query i and key j."""
        n = self.window**2
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]  # (N * N, H)
        return bias.view(n, n, -1).permute(2, 0, 1)

    def forward(
        self, x: Tensor, memory: Tensor | None = None, *, need_weights: bool = False, **unset: Any
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, size * size, C) -> (B, size * size, C), and with ``need_weights`` the weights
        (B * nW, H, N, N) of every window; a ``TransformerBlock``'s other arguments must be unset."""
        if memory is not None or self._any_set(unset):
            raise ValueError(
                "window attention is self-attention over a whole feature map with its own relative "
                "bias: no masks, caches or other positions"
            )
        b, _, c = x.shape
        s, w = self.size, self.window
        x = x.view(b, s, s, c)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        windows = window_partition(x, w)  # (B * nW, N, C)
        mask = self.relative_position_bias()[None]  # (1, H, N, N)
        if self.shift_mask is not None:
            allowed = self.shift_mask.repeat(b, 1, 1)[:, None]  # (B * nW, 1, N, N)
            mask = torch.where(allowed, mask, float("-inf"))
        y, weights = super().forward(windows, attn_mask=mask, need_weights=need_weights)
        y = window_reverse(y, w, s, s)  # (B, S, S, C)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        return y.reshape(b, s * s, c), weights

    def extra_repr(self) -> str:
        return f"size={self.size}, window={self.window}, shift={self.shift}"
