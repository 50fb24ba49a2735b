"""Scaled dot-product and multi-head attention (Vaswani et al. 2017). Masks, everywhere in attnlab:
boolean (True: may attend) or float (added to the scores, ``-inf`` blocks), broadcast to (B, H, T_q,
T_k); a padding mask is (B, T_k), True at padding; ``causal`` is bottom-right aligned."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.core.hardware import native_bf16_cpu
from attnlab.core.specs import DropRate, PositiveInt
from attnlab.nn import health
from attnlab.nn.flash_pieces import flash_pieces, pieces_apply
from attnlab.nn.flex import flex_attend
from attnlab.nn.positions import RelativePositions

AttentionImpl = Literal["auto", "sdpa", "flex", "math"]
QKNorm = Literal[False, True, "layernorm", "rmsnorm"]  # true: layernorm

# what a TransformerBlock passes its attention layer besides x, memory and need_weights
BLOCK_ARGS = frozenset({"attn_mask", "key_padding_mask", "causal", "cache", "positions"})

log = logging.getLogger(__name__)
_announced: set[tuple] = set()


def causal_mask(t_q: int, t_k: int, device: torch.device | None = None) -> Tensor:
    """Boolean (t_q, t_k), the queries being the last ``t_q`` of the keys (a new token sees the cache)."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


def _compute_dtype(q: Tensor) -> torch.dtype:
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return q.dtype


@torch.compiler.assume_constant_result
def _native_bf16() -> bool:
    """A constant to a compiled block: dynamo cannot trace the CPU probes (a graph break per block)."""
    return native_bf16_cpu()


def choose_impl(impl: AttentionImpl, q: Tensor, need_weights: bool, fused_only: bool, dropout: bool) -> str:
    """The path a call takes, ``impl`` unless "auto" (``benchmarks/attention_paths.py``): "math" (it
    alone returns the weights) for the weights and for bf16 on a CPU with native bf16; "flex" on a GPU
    for a bias or window (``fused_only``) without dropout (it has none; no CPU backward); else "sdpa"."""
    if need_weights:
        return "math"
    if impl != "auto":
        return impl
    if q.device.type == "cuda" and fused_only and not dropout:
        choice = "flex"
    elif q.device.type == "cpu" and _compute_dtype(q) == torch.bfloat16 and _native_bf16():
        # measured (benchmarks/RESULTS.md): under bf16 the explicit path is faster on CPUs with
        # native bf16, and slower on CPUs without it, where SDPA's kernels upcast
        choice = "math"
    else:
        choice = "sdpa"
    key = (q.device.type, _compute_dtype(q), fused_only, dropout, choice)
    if key not in _announced and not torch.compiler.is_compiling():
        _announced.add(key)
        kind = "a bias or window" if fused_only else "plain masks"
        log.info(f"attention on {q.device.type} in {key[1]} with {kind}: attn_impl=auto takes {choice}")
    return choice


def _block(mask: Tensor | None, allowed: Tensor) -> Tensor:
    """``mask`` (bool or float) where ``allowed`` too."""
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


def with_bias(mask: Tensor | None, bias: Tensor) -> Tensor:
    """A float mask: ``bias`` added to ``mask`` (bool or float), ``-inf`` where it blocks."""
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return mask + bias


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
    """softmax(q k^T / sqrt(d) + mask) v over (B, H, T, D) tensors, and with ``need_weights`` the
    weights (B, H, T_q, T_k)."""
    if impl == "flex":
        raise ValueError("flex attention needs positions and structure: call MultiHeadAttention.attend")
    t_q, t_k = q.size(-2), k.size(-2)
    use_math = choose_impl(impl, q, need_weights, fused_only=False, dropout=dropout_p > 0) == "math"
    if not use_math and causal and mask is None and t_q == t_k:
        # the fused kernels have their own (faster) causal path
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return y, None
    if causal and t_q > 1:
        mask = _block(mask, causal_mask(t_q, t_k, q.device))
    if not use_math:
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(_compute_dtype(q))  # SDPA wants a float mask in the query's dtype
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return y, None
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T_q, T_k)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else att + mask
    att = F.softmax(att, dim=-1)
    weights = att if need_weights else None
    if dropout_p > 0.0:
        att = F.dropout(att, p=dropout_p)
    return att @ v, weights


class KVCache:
    """Keys and values (B, n_kv_head, T, D) of one layer across decoding steps, with each key's
    position (``seen``: the next token's), or a cross-attention memory projected once (``static``)."""

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None, static: bool = False) -> None:
        self.k, self.v, self.static = k, v, static
        self.seen = 0 if k is None else k.size(-2)
        self.positions = None if k is None else torch.arange(self.seen, device=k.device)  # (T,)

    @classmethod
    def of_memory(cls, attn: MultiHeadAttention, memory: Tensor) -> KVCache:
        return cls(*attn.project_memory(memory), static=True)

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.size(-2)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        new = torch.arange(self.seen, self.seen + k.size(-2), device=k.device)
        if self.k is None:
            self.k, self.v, self.positions = k, v, new
        else:
            self.forget()
            self.k, self.v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
            self.positions = torch.cat([self.positions, new])
        self.seen += k.size(-2)
        return self.k, self.v

    def forget(self) -> None:
        """Drop keys the next queries cannot see (none here: full attention sees every one)."""

    def reorder(self, index: Tensor) -> None:
        """Keep the rows at ``index`` (beam search)."""
        if self.k is not None:
            self.k, self.v = self.k[index], self.v[index]


class AttentionSpec(TypedDict, total=False):
    """The attention settings a model hands to every attention layer, as flat keys
    (``model.net.n_kv_head``); the defaults are ``attention_layer``'s."""

    attn_impl: AttentionImpl
    attn_dropout: DropRate
    n_kv_head: PositiveInt | None  # None: n_head
    qk_norm: QKNorm


def attention_layer(
    cls: type[MultiHeadAttention] | None = None,
    attn_impl: AttentionImpl = "auto",
    attn_dropout: float = 0.0,
    n_kv_head: int | None = None,
    qk_norm: QKNorm = False,
    **extra: Any,
) -> Callable[..., MultiHeadAttention]:
    """``cls`` with a model's ``AttentionSpec``: a ``TransformerBlock``'s ``attn_layer``."""
    return partial(
        cls or MultiHeadAttention,
        impl=attn_impl,
        dropout=attn_dropout,
        n_kv_head=n_kv_head,
        qk_norm=qk_norm,
        **extra,
    )


def _qk_norm(kind: QKNorm, head_dim: int) -> nn.Module:
    if kind is False:
        return nn.Identity()
    return nn.RMSNorm(head_dim, eps=1e-6) if kind == "rmsnorm" else nn.LayerNorm(head_dim, eps=1e-6)


class MultiHeadAttention(nn.Module):
    """Self- (``memory=None``) and cross-attention, with one packed ``in_proj`` of q, k, v
    (``torch.nn.MultiheadAttention``'s layout, so weights copy across). ``n_kv_head`` < ``n_head``:
    grouped-query attention; ``qk_norm``: a norm per head on q and k (ViT-22B, OLMo); ``kv_dim``: a
    memory's width other than ``dim`` (``kv_proj``; such a layer attends only to a memory)."""

    def __init__(
        self,
        dim: PositiveInt,
        n_head: PositiveInt,
        dropout: DropRate = 0.0,
        bias: bool = True,
        impl: AttentionImpl = "auto",
        kv_dim: PositiveInt | None = None,
        n_kv_head: PositiveInt | None = None,
        qk_norm: QKNorm = False,
    ) -> None:
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if dim % n_head != 0:
            raise ValueError(f"dim: must be divisible by n_head ({n_head}), got {dim}")
        if n_kv_head < 1 or n_head % n_kv_head != 0:
            raise ValueError(f"n_kv_head: must divide n_head ({n_head}), got {n_kv_head}")
        if impl == "flex" and dropout > 0:
            raise ValueError(
                f"attn_impl=flex has no attention dropout: set it to 0 (got {dropout}) or use sdpa"
            )
        self.dim, self.n_head, self.n_kv_head = dim, n_head, n_kv_head
        self.dropout, self.impl = dropout, impl
        self.head_dim = dim // n_head
        self.kv_width = n_kv_head * self.head_dim
        if kv_dim is None:
            self.in_proj = nn.Linear(dim, dim + 2 * self.kv_width, bias=bias)
            self.kv_proj = None
        else:
            self.in_proj = nn.Linear(dim, dim, bias=bias)
            self.kv_proj = nn.Linear(kv_dim, 2 * self.kv_width, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.q_norm, self.k_norm = _qk_norm(qk_norm, self.head_dim), _qk_norm(qk_norm, self.head_dim)

    def _split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def _rows(self, rows: slice) -> tuple[Tensor, Tensor | None]:
        w, b = self.in_proj.weight, self.in_proj.bias
        return w[rows], None if b is None else b[rows]

    def _q(self, x: Tensor) -> Tensor:
        return self.q_norm(self._split_heads(F.linear(x, *self._rows(slice(0, self.dim)))))

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, n_kv_head, S, D) of ``memory`` (B, S, C)."""
        if self.kv_proj is not None:
            kv = self.kv_proj(memory)
        else:
            kv = F.linear(memory, *self._rows(slice(self.dim, None)))
        k, v = kv.split(self.kv_width, dim=-1)
        return self.k_norm(self._split_heads(k)), self._split_heads(v)

    def _qkv(
        self,
        x: Tensor,
        memory: Tensor | None,
        cache: KVCache | None,
        positions: RelativePositions | None = None,
        start: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, D), keys and values (B, n_kv_head, T_k, D)."""
        if cache is not None and cache.static:  # cross-attention to a memory projected once
            return self._q(x), cache.k, cache.v
        if memory is None:  # self-attention: one matmul for q, k and v
            if self.kv_proj is not None:
                raise ValueError("an attention layer with its own kv_dim attends only to a memory")
            qkv = self.in_proj(x).split([self.dim, self.kv_width, self.kv_width], dim=-1)
            q, k, v = map(self._split_heads, qkv)
            q, k = self.q_norm(q), self.k_norm(k)
            if positions is not None:  # RoPE: turned at their positions, keys before the cache
                pos = torch.arange(start, start + x.size(1), device=x.device)
                q, k = positions.rotate(q, pos), positions.rotate(k, pos)
        else:
            q, (k, v) = self._q(x), self.project_memory(memory)
        if cache is not None:
            k, v = cache.append(k, v)
        return q, k, v

    def repeat_kv(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        n = self.n_head // self.n_kv_head
        return (k, v) if n == 1 else (k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1))

    def new_cache(self) -> KVCache:
        return KVCache()

    def _any_set(self, unset: dict[str, Any]) -> bool:
        """Whether any of a ``TransformerBlock``'s arguments a subclass takes as ``**unset`` is set
        (not None or False); a name the block never passes is a TypeError, as Python's own."""
        unknown = sorted(unset.keys() - BLOCK_ARGS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.forward() got an unexpected keyword argument {unknown[0]!r}"
            )
        return any(v is not None and v is not False for v in unset.values())

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
        """(B, H, T_q, D) queries over keys at positions ``q_pos`` (T_q,), ``k_pos`` (T_k,): every
        pair scored (subclasses score fewer)."""
        dropout = self.dropout if self.training else 0.0
        fused_only = positions is not None and positions.adds_bias
        impl = choose_impl(self.impl, q, need_weights, fused_only, dropout > 0)
        if impl == "flex":
            y = flex_attend(q, k, v, mask=mask, causal=causal, positions=positions, q_pos=q_pos, k_pos=k_pos)
            return y, None
        if impl == "sdpa" and fused_only and pieces_apply(q, k, mask, causal, positions, dropout):
            return flash_pieces(q, k, v, positions), None
        bias = positions.bias(k_pos[None, :] - q_pos[:, None]) if positions is not None else None
        if bias is not None:  # (H, T_q, T_k)
            if causal:  # in the mask with the bias: the fused causal path takes no bias
                mask = _block(mask, k_pos[None, :] <= q_pos[:, None])
                causal = False
            mask = with_bias(mask, bias)
        return scaled_dot_product_attention(q, k, v, mask, causal, dropout, need_weights, impl)

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
        positions: RelativePositions | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` (B, T_q, C) to itself or to ``memory`` (B, T_k, C), or to a ``cache``'s
        memory (``KVCache.of_memory``). Returns (B, T_q, C) and maybe the weights (B, H, T_q, T_k)."""
        b, t, c = x.shape
        own = cache is not None and not cache.static  # a self-attention cache, x after its keys
        start = cache.seen if own else 0
        q, k, v = self._qkv(x, memory, cache, positions, start)
        k, v = self.repeat_kv(k, v)  # the cache keeps n_kv_head heads
        mask = attn_mask
        if key_padding_mask is not None:
            mask = _block(mask, ~key_padding_mask[:, None, None, :])  # (B, 1, 1, T_k)
        q_pos = torch.arange(start, start + t, device=x.device)
        k_pos = cache.positions if own else torch.arange(k.size(-2), device=x.device)
        y, weights = self.attend(q, k, v, mask, causal, positions, q_pos, k_pos, need_weights)
        if health.is_recording() and cache is None:  # a probe's forward, not a decoding step
            pad = key_padding_mask if memory is None else None
            self._record(q, k, v, mask, causal, positions, q_pos, k_pos, weights, pad)
        y = y.transpose(1, 2).reshape(b, t, c)  # (B, T_q, C)
        return self.out_proj(y), weights

    @torch.compiler.disable
    def _record(self, q, k, v, mask, causal, positions, q_pos, k_pos, weights, padding) -> None:
        """Record the first rows' weights as the math path gives them, padding queries' rows NaN;
        without dropout, so the random state and the output stay."""
        n = health.rows()
        if weights is None:
            if mask is not None and mask.dim() == 4:
                mask = mask[:n]
            training, self.training = self.training, False
            try:
                _, weights = self.attend(q[:n], k[:n], v[:n], mask, causal, positions, q_pos, k_pos, True)
            finally:
                self.training = training
        weights = weights[:n]
        if padding is not None:
            weights = weights.masked_fill(padding[:n, None, :, None], float("nan"))
        health.record(self, weights, q_pos, k_pos)
