"""Causal local attention: each token sees the ``window`` most recent tokens (Longformer's and
Mistral's sliding window) and the first ``n_global`` (Longformer's and BigBird's global tokens), at
a cost linear in the length; a decoding step's cache forgets the keys no later query sees."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.core.specs import PositiveInt
from attnlab.nn.attention import (
    KVCache,
    MultiHeadAttention,
    choose_impl,
    scaled_dot_product_attention,
    with_bias,
)
from attnlab.nn.flex import flex_attend, structural_mask
from attnlab.nn.positions import RelativePositions


class LocalKVCache(KVCache):
    """Keeps the keys a future query may still see: the last ``window - 1`` and the first ``n_global``."""

    def __init__(self, window: int, n_global: int = 0) -> None:
        super().__init__()
        self.window, self.n_global = window, n_global

    def forget(self) -> None:
        kept = (self.positions > self.seen - self.window) | (self.positions < self.n_global)
        self.k, self.v, self.positions = self.k[..., kept, :], self.v[..., kept, :], self.positions[kept]


class SlidingWindowAttention(MultiHeadAttention):
    """Causal attention within a sliding window of ``window`` keys (the query's own and the
    ``window - 1`` before it), and to the first ``n_global`` positions. Through FlexAttention a block
    mask; else queries in blocks of ``window``, each against its and the previous block's keys."""

    def __init__(self, dim: int, n_head: int, window: PositiveInt, n_global: int = 0, **kwargs: Any) -> None:
        super().__init__(dim, n_head, **kwargs)
        self.window, self.n_global = window, n_global

    def new_cache(self) -> LocalKVCache:
        return LocalKVCache(self.window, self.n_global)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        causal: bool,
        positions: RelativePositions | None,
        q_pos: Tensor,
        k_pos: Tensor,
        need_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        if mask is not None or not causal:
            raise ValueError("local attention is causal self-attention: no other masks")
        dropout = self.training and self.dropout > 0
        if choose_impl(self.impl, q, need_weights, fused_only=True, dropout=dropout) == "flex":
            # the window as a block mask: blocks outside it are skipped, nothing is copied
            y = flex_attend(
                q, k, v, mask=None, causal=True, positions=positions, q_pos=q_pos, k_pos=k_pos,
                window=self.window, n_global=self.n_global,
            )  # fmt: skip
            return y, None
        t_q, t_k = q.size(-2), k.size(-2)
        if need_weights or t_q != t_k or t_k <= self.window:
            # every pair scored, those outside the window blocked: the weights as a (T_q, T_k)
            # matrix, a decoding step (at most window + n_global cached keys), or a short sequence
            allowed = structural_mask(True, self.window, self.n_global)(None, None, q_pos[:, None], k_pos)
            return super().attend(q, k, v, allowed, False, positions, q_pos, k_pos, need_weights)
        return self.blocked(q, k, v, positions), None

    def blocked(self, q: Tensor, k: Tensor, v: Tensor, positions: RelativePositions | None) -> Tensor:
        """The attention over a whole sequence (positions 0..T-1) in blocks: O(T * window)."""
        b, h, t, d = q.shape
        w, g = self.window, self.n_global
        n = -(-t // w)  # blocks
        pad = n * w - t
        qb = F.pad(q, (0, 0, 0, pad)).view(b, h, n, w, d)  # (B, H, n, w, D)
        # block i's keys: the window before it and its own, positions (i-1)w .. (i+1)w - 1
        kb = F.pad(k, (0, 0, w, pad)).unfold(2, 2 * w, w).transpose(-1, -2)  # (B, H, n, 2w, D)
        vb = F.pad(v, (0, 0, w, pad)).unfold(2, 2 * w, w).transpose(-1, -2)
        q_pos = torch.arange(n * w, device=q.device).view(n, w, 1)  # (n, w, 1)
        k_pos = torch.arange(-w, w, device=q.device) + w * torch.arange(n, device=q.device)[:, None]
        k_pos = k_pos[:, None]  # (n, 1, 2w)
        allowed = (q_pos - k_pos >= 0) & (q_pos - k_pos < w) & (k_pos >= 0)  # (n, w, 2w)
        if g:  # the global keys, where the local ones do not already hold them
            g_pos = torch.arange(min(g, t), device=q.device)
            kb = torch.cat([k[:, :, None, : len(g_pos)].expand(-1, -1, n, -1, -1), kb], dim=-2)
            vb = torch.cat([v[:, :, None, : len(g_pos)].expand(-1, -1, n, -1, -1), vb], dim=-2)
            g_allowed = q_pos - g_pos >= w  # (n, w, g): older than the window
            k_pos = torch.cat([g_pos.expand(n, 1, -1), k_pos], dim=-1)
            allowed = torch.cat([g_allowed.expand(n, w, -1), allowed], dim=-1)  # (n, w, g + 2w)
        mask = allowed.expand(h, -1, -1, -1)  # (H, n, w, K)
        bias = positions.bias((k_pos - q_pos).expand_as(allowed)) if positions is not None else None
        if bias is not None:  # (H, n, w, K)
            mask = with_bias(mask, bias)
        # blocks as heads of one 4-D call: the fused kernels take (B, heads, T, D) only, and keep
        # no attention weights for the backward pass
        qb, kb, vb = (z.reshape(b, h * n, z.size(-2), d) for z in (qb, kb, vb))
        mask = mask.reshape(h * n, w, -1)
        dropout = self.dropout if self.training else 0.0
        y, _ = scaled_dot_product_attention(qb, kb, vb, mask=mask, dropout_p=dropout, impl=self.impl)
        return y.reshape(b, h, n * w, d)[:, :, :t]  # (B, H, T, D)


class GlobalLocalAttention(SlidingWindowAttention):
    """Sliding-window attention with ``n_global`` >= 1 global tokens (a [CLS], a prompt's start)."""

    def __init__(
        self, dim: int, n_head: int, window: PositiveInt, n_global: PositiveInt, **kwargs: Any
    ) -> None:
        super().__init__(dim, n_head, window, n_global, **kwargs)
