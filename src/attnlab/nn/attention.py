"""Scaled dot-product and multi-head attention (Vaswani et al. 2017).

Two interchangeable paths compute the same thing:
- ``sdpa``: ``F.scaled_dot_product_attention`` (fused kernels; the fast path on GPU and in fp32 on CPU);
- ``math``: an explicit matmul + softmax that can return the attention weights (for plots and
  tests) and, on CPU under bf16 autocast, is faster than SDPA (see STACK-NOTES).
``impl="auto"`` picks ``math`` when weights are wanted or when running on CPU under autocast.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.errors import ConfigError

AttentionImpl = Literal["auto", "sdpa", "math"]


def causal_mask(t_q: int, t_k: int, device: torch.device | None = None) -> Tensor:
    """Boolean (t_q, t_k) mask, True where query i may attend key j.

    Queries are the last ``t_q`` positions of the ``t_k`` keys (bottom-right aligned), which is
    what a KV cache needs: a new token sees every cached position and itself.
    """
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


def _use_math(q: Tensor, impl: AttentionImpl, need_weights: bool) -> bool:
    if need_weights or impl == "math":
        return True
    if impl == "sdpa":
        return False
    return q.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    impl: AttentionImpl = "auto",
) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T / sqrt(d) + mask) v over (B, H, T, D) tensors.

    ``mask`` is boolean and broadcastable to (B, H, T_q, T_k), True where attention is allowed.
    ``causal`` adds a bottom-right aligned causal mask. Returns the output (B, H, T_q, D) and,
    with ``need_weights``, the attention weights (B, H, T_q, T_k).
    """
    t_q, t_k = q.size(-2), k.size(-2)
    use_math = _use_math(q, impl, need_weights)
    if not use_math and causal and mask is None and t_q == t_k:
        # the fused kernels have their own (faster) causal path
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return y, None
    if causal and t_q > 1:
        cm = causal_mask(t_q, t_k, q.device)
        mask = cm if mask is None else mask & cm
    if not use_math:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return y, None
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T_q, T_k)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    weights = att if need_weights else None
    if dropout_p > 0.0:
        att = F.dropout(att, p=dropout_p)
    return att @ v, weights


class KVCache:
    """Keys and values of the positions seen so far, for one attention layer."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.size(-2)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new positions' (B, H, T, D) keys and values; return all of them."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=-2)
            self.v = torch.cat([self.v, v], dim=-2)
        return self.k, self.v


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self-attention (``memory=None``) and cross-attention.

    The projection layout matches ``torch.nn.MultiheadAttention`` (one packed ``in_proj`` of
    q, k, v, then ``out_proj``) so weights copy across, and self-attention runs as one matmul.

    Args:
        d_model: model width; split into ``n_head`` heads of ``d_model // n_head``.
        n_head: number of heads.
        dropout: dropout on the attention weights (training only).
        bias: whether the projections have biases.
        impl: "auto", "sdpa" or "math" (see module docstring).
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        dropout: float = 0.0,
        bias: bool = True,
        impl: AttentionImpl = "auto",
    ) -> None:
        super().__init__()
        if n_head <= 0 or d_model <= 0 or d_model % n_head != 0:
            raise ConfigError(
                f"d_model/n_embd ({d_model}) must be a positive multiple of n_head ({n_head})"
            )
        if impl not in ("auto", "sdpa", "math"):
            raise ConfigError(f"attention impl must be 'auto', 'sdpa' or 'math', got {impl!r}")
        self.d_model, self.n_head, self.dropout, self.impl = d_model, n_head, dropout, impl
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, -1).transpose(1, 2)  # (B, H, T, D)

    def _project(self, x: Tensor, memory: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        if memory is None:
            return self.in_proj(x).split(self.d_model, dim=-1)
        w, b = self.in_proj.weight, self.in_proj.bias
        q = F.linear(x, w[: self.d_model], None if b is None else b[: self.d_model])
        kv = F.linear(memory, w[self.d_model :], None if b is None else b[self.d_model :])
        return (q, *kv.split(self.d_model, dim=-1))

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` (B, T_q, C) to itself or to ``memory`` (B, T_k, C).

        Args:
            key_padding_mask: (B, T_k) bool, True at padding keys (ignored), as in
                ``nn.MultiheadAttention``.
            attn_mask: bool, broadcastable to (B, H, T_q, T_k), True where attention is allowed.
            causal: each query sees only keys at or before its own position.
            cache: keys/values of earlier positions; the new ones are appended to it.
            need_weights: also return the (B, H, T_q, T_k) attention weights.
        """
        b, t, c = x.shape
        q, k, v = (self._split_heads(z) for z in self._project(x, memory))
        if cache is not None:
            k, v = cache.append(k, v)
        mask = attn_mask
        if key_padding_mask is not None:
            keep = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, T_k)
            mask = keep if mask is None else mask & keep
        y, weights = scaled_dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            impl=self.impl,
        )
        y = y.transpose(1, 2).reshape(b, t, c)  # (B, T_q, C)
        return self.out_proj(y), weights
