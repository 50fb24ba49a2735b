"""Self-attention inside (shifted) windows of a feature map, with a relative position bias: the
attention of the Swin Transformer (Liu et al. 2021).

A feature map of R x R tokens is cut into windows of w x w tokens; each token attends only to the
tokens of its own window, so the cost grows with R^2 w^2 instead of R^4. Every other block shifts
the map by w/2 (cyclically) before cutting it, so information crosses window borders; the tokens
that wrapped around the map's edge land in windows with tokens that were never their neighbours,
and a mask keeps them apart.
"""

from __future__ import annotations

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
    """Multi-head self-attention within ``window`` x ``window`` windows of a ``size`` x ``size``
    feature map, shifted by ``shift`` tokens first, plus a learned bias per head and relative offset.

    Takes the place of ``MultiHeadAttention`` in a ``TransformerBlock`` (``attn_layer``): it reads
    the block's (B, size * size, C) tokens as a map. Weights copy from timm's ``WindowAttention``
    (``qkv`` -> ``in_proj``, ``proj`` -> ``out_proj``).

    Args:
        dim, n_head, dropout, bias, impl: see ``MultiHeadAttention``.
        size: side of the feature map, in tokens.
        window: side of a window; must divide ``size``.
        shift: cyclic shift before partitioning (``window // 2`` in every other block), or 0.
    """

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
        """(H, N, N): the bias each head adds to the score of query i and key j."""
        n = self.window**2
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]  # (N * N, H)
        return bias.view(n, n, -1).permute(2, 0, 1)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        causal: bool = False,
        cache: object | None = None,
        need_weights: bool = False,
        positions: object | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, size * size, C) -> (B, size * size, C), and with ``need_weights`` the weights
        (B * nW, H, N, N) of every window."""
        extras = (memory, key_padding_mask, attn_mask, cache, positions)
        if causal or any(e is not None for e in extras):
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
