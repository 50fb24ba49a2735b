"""Scaled dot-product and multi-head attention (Vaswani et al. 2017).

Masks, everywhere in attnlab: an attention mask is **boolean** (True where a query may attend a
key, as ``F.scaled_dot_product_attention``) or **float** (added to the scores; ``-inf`` blocks),
broadcast to (B, H, T_q, T_k); a padding mask is boolean (B, T_k), True at padding keys;
``causal=True`` adds a bottom-right aligned causal mask (queries are the last T_q of T_k keys).

Three paths compute the same thing (``impl``, a model's ``attn_impl``): ``sdpa`` (fused kernels; a
causal ALiBi or T5 bias over a long sequence on a CPU goes to its flash kernel in pieces,
``nn/flash_pieces.py``), ``flex`` (``nn/flex.py``: masks and biases as functions in one compiled
kernel; no attention dropout) and ``math`` (matmul + softmax; returns the weights). ``auto``
(``choose_impl``, as ``benchmarks/attention_paths.py`` measured): ``math`` when the weights are
wanted and for bf16 on a CPU with native bf16, ``flex`` on a GPU for a bias or a window (without
dropout; never on a CPU: no CPU backward), else ``sdpa``.

Relative positions (``nn/positions.py``) come in through ``forward(positions=...)``: RoPE turns
q and k (keys before they are cached), ALiBi and T5 add their bias to the mask. Subclasses change
which pairs are scored (``attend``) and how decoding remembers (``new_cache``).
"""

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
from attnlab.nn.flash_pieces import BLOCK, flash_pieces, pieces_apply
from attnlab.nn.flex import flex_attend
from attnlab.nn.positions import RelativePositions

AttentionImpl = Literal["auto", "sdpa", "flex", "math"]
QKNorm = Literal[False, True, "layernorm", "rmsnorm"]  # true: layernorm

log = logging.getLogger(__name__)
_announced: set[tuple] = set()


def causal_mask(t_q: int, t_k: int, device: torch.device | None = None) -> Tensor:
    """Boolean (t_q, t_k) mask, True where query i may attend key j; the queries are the last
    ``t_q`` of the ``t_k`` keys (bottom-right aligned: a new token sees the cache and itself)."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


def _compute_dtype(q: Tensor) -> torch.dtype:
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return q.dtype


@torch.compiler.assume_constant_result
def _native_bf16() -> bool:
    """``native_bf16_cpu``, a constant to a compiled block: dynamo cannot trace the CPU probes,
    and a graph break in every block would split the compiled code."""
    return native_bf16_cpu()


def choose_impl(impl: AttentionImpl, q: Tensor, need_weights: bool, fused_only: bool, dropout: bool) -> str:
    """The path a call takes: ``impl`` itself unless "auto" (see the module docstring).

    ``fused_only``: the call has a bias or a window that only FlexAttention keeps in a fused
    kernel; ``dropout``: attention dropout is active (FlexAttention has none).
    """
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
    """Combine an attention mask (bool or float, see above) with a boolean ``allowed`` mask."""
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


def with_bias(mask: Tensor | None, bias: Tensor) -> Tensor:
    """A float mask: ``bias`` added to ``mask`` (bool or float, see above), ``-inf`` where blocked."""
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
    """softmax(q k^T / sqrt(d) + mask) v over (B, H, T, D) tensors.

    ``mask``: boolean or float, broadcastable to (B, H, T_q, T_k) (see the module docstring).
    ``causal`` adds a bottom-right aligned causal mask. Returns the output (B, H, T_q, D) and,
    with ``need_weights``, the attention weights (B, H, T_q, T_k).
    """
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


def _in_pieces(
    q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, positions: RelativePositions, dropout: float
) -> bool:
    """Whether a CPU's flash kernel takes this call in pieces (``nn/flash_pieces.py``): a causal
    ALiBi or T5 bias over a whole sequence longer than a block, and nothing else."""
    whole = q.size(-2) == k.size(-2) > BLOCK  # positions 0..T-1: no cache
    plain = causal and mask is None and dropout == 0
    return q.device.type == "cpu" and whole and plain and pieces_apply(positions)


class KVCache:
    """Keys and values (B, n_kv_head, T, D) of one attention layer across decoding steps: grown
    by ``append`` with each key's position (``seen``: the next token's), or a cross-attention
    memory projected once (``of_memory``); ``reorder`` follows a beam; subclasses ``forget``."""

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None, static: bool = False) -> None:
        self.k, self.v, self.static = k, v, static
        self.seen = 0 if k is None else k.size(-2)
        self.positions = None if k is None else torch.arange(self.seen, device=k.device)  # (T,)

    @classmethod
    def of_memory(cls, attn: MultiHeadAttention, memory: Tensor) -> KVCache:
        """The keys and values ``attn`` computes from ``memory`` (B, S, C), for cross-attention."""
        return cls(*attn.project_memory(memory), static=True)

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.size(-2)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new positions' (B, H, T, D) keys and values; return all of them."""
        if self.k is not None:
            self.forget()
        new = torch.arange(self.seen, self.seen + k.size(-2), device=k.device)
        self.seen += k.size(-2)
        if self.k is None:
            self.k, self.v, self.positions = k, v, new
        else:
            self.k = torch.cat([self.k, k], dim=-2)
            self.v = torch.cat([self.v, v], dim=-2)
            self.positions = torch.cat([self.positions, new])
        return self.k, self.v

    def forget(self) -> None:
        """Drop keys the next queries cannot see (none here: full attention sees every one)."""

    def keep(self, kept: Tensor) -> None:
        """Keep only the cached keys where ``kept`` (T,) is True."""
        self.k, self.v, self.positions = self.k[..., kept, :], self.v[..., kept, :], self.positions[kept]

    def reorder(self, index: Tensor) -> None:
        """Keep the rows at ``index`` (beam search)."""
        if self.k is not None:
            self.k, self.v = self.k[index], self.v[index]


class AttentionSpec(TypedDict, total=False):
    """The attention settings a model hands to every ``MultiHeadAttention`` it builds: its
    ``**attn``, flat keys (``model.net.n_kv_head``) typed once here; the defaults are
    ``attention_layer``'s."""

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
    """``cls`` (``MultiHeadAttention``) with a model's ``AttentionSpec``: a ``TransformerBlock``'s
    ``attn_layer``."""
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
    """Multi-head attention for self-attention (``memory=None``) and cross-attention.

    One packed ``in_proj`` of q, k, v (``torch.nn.MultiheadAttention``'s layout, so weights copy
    across), then ``out_proj``. ``n_kv_head`` < ``n_head``: grouped-query attention (1: multi-query;
    Llama's ``repeat_kv``), the cache holding ``n_kv_head`` heads. ``qk_norm``: LayerNorm (true,
    "layernorm") or RMSNorm per head on q and k before the scores (ViT-22B, OLMo; timm's
    ``q_norm``/``k_norm``). ``kv_dim``: a cross-attention memory's width other than ``dim``
    (``kv_proj`` then makes the keys and values; such a layer attends only to a memory).
    ``impl``: see the module docstring; "flex" takes no dropout.
    """

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
        self.dim, self.n_head, self.n_kv_head, self.dropout, self.impl = dim, n_head, n_kv_head, dropout, impl
        self.head_dim, self.kv_width = dim // n_head, n_kv_head * (dim // n_head)
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
        """Queries (B, H, T, D), keys and values (B, n_kv_head, T_k, D): the cache's kind."""
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
        """Each of the n_kv_head key and value heads shared by its n_head / n_kv_head query heads."""
        n = self.n_head // self.n_kv_head
        return (k, v) if n == 1 else (k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1))

    def new_cache(self) -> KVCache:
        """An empty self-attention cache of the kind this layer decodes with."""
        return KVCache()

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
        """(B, H, T_q, D) queries over (B, H, T_k, D) keys at positions ``q_pos`` (T_q,) and
        ``k_pos`` (T_k,): every pair scored (subclasses score fewer)."""
        dropout = self.dropout if self.training else 0.0
        fused_only = positions is not None and positions.adds_bias
        impl = choose_impl(self.impl, q, need_weights, fused_only, dropout > 0)
        if impl == "flex":
            y = flex_attend(q, k, v, mask=mask, causal=causal, positions=positions, q_pos=q_pos, k_pos=k_pos)
            return y, None
        if impl == "sdpa" and fused_only and _in_pieces(q, k, mask, causal, positions, dropout):
            return flash_pieces(q, k, v, positions), None
        bias = positions.bias(k_pos[None, :] - q_pos[:, None]) if positions is not None else None
        if bias is not None:  # (H, T_q, T_k)
            if causal:  # in the mask with the bias: the fused causal path takes no bias
                mask, causal = _block(mask, k_pos[None, :] <= q_pos[:, None]), False
            mask = with_bias(mask, bias)
        return scaled_dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            dropout_p=dropout,
            need_weights=need_weights,
            impl=impl,
        )

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
        """Attend from ``x`` (B, T_q, C) to itself or to ``memory`` (B, T_k, C); masks as in the
        module docstring. ``cache``: a self-attention cache (the new keys and values appended) or a
        cross-attention one (``KVCache.of_memory``: no ``memory`` then). Returns (B, T_q, C) and,
        with ``need_weights``, the weights (B, H, T_q, T_k)."""
        b, t, c = x.shape
        start = cache.seen if cache is not None and not cache.static else 0  # x's first position
        q, k, v = self._qkv(x, memory, cache, positions, start)
        k, v = self.repeat_kv(k, v)  # the cache keeps n_kv_head heads
        mask = attn_mask
        if key_padding_mask is not None:
            mask = _block(mask, ~key_padding_mask[:, None, None, :])  # (B, 1, 1, T_k)
        q_pos = torch.arange(start, start + t, device=x.device)
        k_pos = cache.positions if cache is not None and not cache.static else None
        if k_pos is None:
            k_pos = torch.arange(k.size(-2), device=x.device)
        y, weights = self.attend(q, k, v, mask, causal, positions, q_pos, k_pos, need_weights)
        if health.is_recording() and cache is None:  # a probe's forward, not a decoding step
            pad = key_padding_mask if memory is None else None
            self._record(q, k, v, mask, causal, positions, q_pos, k_pos, weights, pad)
        y = y.transpose(1, 2).reshape(b, t, c)  # (B, T_q, C)
        return self.out_proj(y), weights

    @torch.compiler.disable
    def _record(self, q, k, v, mask, causal, positions, q_pos, k_pos, weights, padding) -> None:
        """Record the first rows' weights as the math path gives them (``attnlab.nn.health``),
        padding queries' rows NaN; without dropout, so the random state and the output stay."""
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
