"""Relative positions, applied inside the attention: RoPE (Su et al. 2021) turns queries and keys
(``rotate``); ALiBi (Press et al. 2022) and T5 (Raffel et al. 2020) add a per-head bias (``bias``)
of ``relative = key position - query position`` (<= 0 for the past, T5's sign)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

Positions = Literal["learned", "sinusoidal", "rope", "alibi", "t5", "none"]


class RelativePositions(nn.Module):
    """The two hooks an attention layer calls (``forward(positions=...)``); each subclass overrides
    one. One instance serves every layer of a model (T5 shares its table across layers)."""

    adds_bias = False  # whether ``bias`` adds to the scores (ALiBi, T5)

    def rotate(self, x: Tensor, pos: Tensor) -> Tensor:
        """Queries or keys (B, H, T, D) at absolute positions ``pos`` (T,), position applied."""
        return x

    def bias(self, relative: Tensor) -> Tensor | None:
        """Score bias (H, *relative.shape) for ``relative`` (key - query positions), or ``None``."""
        return None


class Rotary(RelativePositions):
    """RoPE: pair i of a head's dims (i, i + D/2, as GPT-NeoX and Llama) is turned by the angle
    ``pos * base^(-2i/D)``; keys are turned before they are cached."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,)

    def rotate(self, x: Tensor, pos: Tensor) -> Tensor:
        angles = pos[:, None].float() * self.inv_freq  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D)
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * angles.cos() + torch.cat((-x2, x1), dim=-1) * angles.sin()).to(x.dtype)


def alibi_slopes(n_head: int) -> list[float]:
    """Press et al.'s head slopes: for 2^k heads the geometric sequence starting at and stepping by
    2^(-8/n); otherwise the 2^k heads below n, then every other slope of 2^(k+1) heads."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_head).is_integer():
        return power_of_two(n_head)
    below = 2 ** math.floor(math.log2(n_head))
    return power_of_two(below) + alibi_slopes(2 * below)[0::2][: n_head - below]


class ALiBi(RelativePositions):
    """ALiBi: head h adds ``slope_h * relative`` to its scores, a penalty growing linearly with the
    distance to the key; no position is ever embedded, so nothing is out of range at any length.
    ``symmetric`` (encoders): ``-slope_h * |relative|`` on both sides."""

    adds_bias = True

    def __init__(self, n_head: int, symmetric: bool = False) -> None:
        super().__init__()
        self.symmetric = symmetric
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_head)), persistent=False)  # (H,)

    def bias(self, relative: Tensor) -> Tensor:
        rel = -relative.abs() if self.symmetric else relative
        return self.slopes.view(-1, *[1] * rel.dim()) * rel.float()  # (H, ...)


def t5_bucket(
    relative: Tensor, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket of each offset: exact for the small ones, log-spaced up to ``max_distance``, the
    last bucket beyond; ``bidirectional`` gives the future half of the buckets."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # the future counts as distance 0
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


class T5RelativeBias(RelativePositions):
    """T5: a learned scalar per head and bucket of offsets (``t5_bucket``), added to the scores;
    ``causal``: the future is never seen, so all buckets go to the past."""

    adds_bias = True

    def __init__(self, n_head: int, causal: bool, num_buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__()
        self.causal, self.num_buckets, self.max_distance = causal, num_buckets, max_distance
        self.table = nn.Embedding(num_buckets, n_head)

    def bias(self, relative: Tensor) -> Tensor:
        bucket = t5_bucket(relative, not self.causal, self.num_buckets, self.max_distance)
        return self.table(bucket).movedim(-1, 0)  # (H, ...)


def relative_positions(kind: Positions, head_dim: int, n_head: int, causal: bool) -> RelativePositions | None:
    """The ``RelativePositions`` ``kind`` names; ``None`` for the absolute ones and "none"."""
    if kind == "rope":
        return Rotary(head_dim)
    if kind == "alibi":
        return ALiBi(n_head, symmetric=not causal)
    if kind == "t5":
        return T5RelativeBias(n_head, causal)
    return None
