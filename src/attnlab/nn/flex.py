"""Attention through FlexAttention: the mask (``mask_mod``) and the score bias (``score_mod``) as small
functions compiled into one fused kernel that skips the blocks the mask rules out; compiled on a GPU
always, on a CPU for inference only (no CPU backward kernel: the eager operator, same numbers)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from functools import lru_cache

import torch
import torch.nn.attention.flex_attention as torch_flex
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from attnlab.nn.positions import RelativePositions

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

COMPILE = True  # tests turn it off to check the eager operator on a CPU without a minutes-long compile


def _pick(mask: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask[b, h, q, k]`` of a mask broadcastable to (B, H, T_q, T_k): index 0 on its size-1 dims."""
    mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    idx = [i if n > 1 else 0 for i, n in zip((b, h, q_idx, kv_idx), mask.shape, strict=True)]
    return mask[idx[0], idx[1], idx[2], idx[3]]


def structural_mask(
    causal: bool, window: int | None, n_global: int, q_pos: Tensor | None = None, k_pos: Tensor | None = None
) -> MaskMod | None:
    """Causal, within ``window`` keys back or among the first ``n_global``, of queries and keys at
    ``q_pos`` (T_q,) and ``k_pos`` (T_k,), or at 0..T-1."""
    if not causal:
        return None

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if q_pos is not None:
            q_idx, kv_idx = q_pos[q_idx], k_pos[kv_idx]
        back = q_idx - kv_idx
        if window is None:
            return back >= 0
        return (back >= 0) & ((back < window) | (kv_idx < n_global))

    return mask_mod


@lru_cache(maxsize=32)
def cached_block_mask(
    causal: bool, window: int | None, n_global: int, t_q: int, t_k: int, device: torch.device
) -> BlockMask:
    """The block mask of a ``structural_mask``: one per shape and run."""
    return create_block_mask(structural_mask(causal, window, n_global), None, None, t_q, t_k, device=device)


def _and(first: MaskMod | None, second: MaskMod | None) -> MaskMod | None:
    if first is None or second is None:
        return first or second
    return lambda b, h, q_idx, kv_idx: first(b, h, q_idx, kv_idx) & second(b, h, q_idx, kv_idx)


def _add(first: ScoreMod | None, second: ScoreMod | None) -> ScoreMod | None:
    if first is None or second is None:
        return first or second
    return lambda score, b, h, q_idx, kv_idx: second(first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)


@torch.compiler.disable
def offset_table(positions: RelativePositions, t: int, device: torch.device) -> Tensor:
    """(H, 2T - 1): the bias at each offset ``key - query``. Outside any compiled graph: the CPU
    kernel refused a score_mod reading a tensor computed there (torch 2.15), not an input."""
    return positions.bias(torch.arange(-(t - 1), t, device=device))


def relative_bias(
    positions: RelativePositions, t_q: int, t_k: int, q_pos: Tensor, k_pos: Tensor
) -> ScoreMod | None:
    """ALiBi's or T5's bias as a ``score_mod``: at positions 0..T-1 from one vector over the offsets,
    never an (H, T, T) matrix; otherwise (decoding: few queries) from an (H, T_q, T_k) one."""
    if t_q == t_k:
        table = offset_table(positions, t_q, q_pos.device)  # (H, 2T - 1)
        return lambda score, b, h, q_idx, kv_idx: score + table[h, kv_idx - q_idx + t_q - 1].to(score.dtype)
    bias = positions.bias(k_pos[None, :] - q_pos[:, None])  # (H, T_q, T_k)
    return lambda score, b, h, q_idx, kv_idx: score + bias[h, q_idx, kv_idx].to(score.dtype)


def mask_mods(mask: Tensor | None) -> tuple[MaskMod | None, ScoreMod | None]:
    """A boolean mask (True: may attend) as a ``mask_mod``; a float mask (added to the scores,
    ``-inf`` blocks) as a ``score_mod`` and, for its ``-inf``, a ``mask_mod``."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return (lambda b, h, q_idx, kv_idx: _pick(mask, b, h, q_idx, kv_idx)), None
    allowed = mask > float("-inf")
    return (
        lambda b, h, q_idx, kv_idx: _pick(allowed, b, h, q_idx, kv_idx),
        lambda score, b, h, q_idx, kv_idx: score + _pick(mask, b, h, q_idx, kv_idx).to(score.dtype),
    )


@contextlib.contextmanager
def _cpu_backward() -> Iterator[None]:
    """Let the eager operator differentiate on a CPU: FlexAttention refuses gradients there only
    because its compiled CPU kernel has no backward; the eager one has (dense, O(T^2) memory)."""
    check = torch_flex._validate_device
    torch_flex._validate_device = lambda *args: None
    try:
        yield
    finally:
        torch_flex._validate_device = check


@lru_cache(maxsize=1)
def _compiled() -> Callable[..., Tensor]:
    return torch.compile(flex_attention, dynamic=False)


def _run(q: Tensor, k: Tensor, v: Tensor, score_mod: ScoreMod | None, block_mask: BlockMask | None) -> Tensor:
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if torch.compiler.is_compiling():  # inside a compiled model: it compiles this call with the rest
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    if COMPILE and q.size(-2) > 1 and (q.device.type != "cpu" or not grads):
        return _compiled()(q, k, v, score_mod=score_mod, block_mask=block_mask)
    with warnings.catch_warnings(), _cpu_backward() if q.device.type == "cpu" else contextlib.nullcontext():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


def flex_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    causal: bool,
    positions: RelativePositions | None,
    q_pos: Tensor,
    k_pos: Tensor,
    window: int | None = None,
    n_global: int = 0,
) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias) v over (B, H, T, D) tensors; ``causal``, ``window`` and
    ``n_global``: which keys each query sees by position; RoPE is already applied. Queries and keys
    are at 0..T-1 whenever T_q == T_k (every call without a cache, and a cache's first)."""
    t_q, t_k = q.size(-2), k.size(-2)
    plain = t_q == t_k  # positions 0..T-1
    extra_mask, float_mod = mask_mods(mask)
    biased = positions is not None and positions.adds_bias
    bias_mod = relative_bias(positions, t_q, t_k, q_pos, k_pos) if biased else None
    score_mod = _add(bias_mod, float_mod)
    if plain and extra_mask is None:
        block_mask = cached_block_mask(causal, window, n_global, t_q, t_k, q.device) if causal else None
    else:
        at = () if plain else (q_pos, k_pos)
        mask_mod = _and(structural_mask(causal, window, n_global, *at), extra_mask)
        block_mask = None
        if mask_mod is not None:
            batch = mask.size(0) if mask is not None and mask.dim() == 4 and mask.size(0) > 1 else None
            heads = mask.size(1) if mask is not None and mask.dim() == 4 and mask.size(1) > 1 else None
            block_mask = create_block_mask(mask_mod, batch, heads, t_q, t_k, device=q.device)
    # contiguous: inside a compiled model, the CPU kernel gave wrong outputs for the strided views
    # the heads are (torch 2.15; tests/test_attention_backends.py checks it)
    return _run(q.contiguous(), k.contiguous(), v.contiguous(), score_mod, block_mask)
