"""Dropout whose mask costs one random byte per element on CPU.

On CPU, ``nn.Dropout`` samples a Bernoulli per element through torch's float sampler, slow enough
to be a visible share of a small Transformer's training step; comparing random bytes to a
threshold gives the same kind of mask for a fraction of that (``benchmarks/dropout.py`` measures
both on your machine). The drop probability is rounded to a multiple of 1/256 (0.2 -> 51/256 =
0.199) and the kept elements are scaled by the exact inverse keep probability, so the expectation
is unchanged. Elsewhere (CUDA's fused kernel is fast) it is ``F.dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.core.specs import DropRate


def byte_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element with probability ~p (a multiple of 1/256) and rescale the rest."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p)
    threshold = min(round(p * 256), 255)  # p below 1/512 rounds to no dropout at all
    # 8 random bytes per int64 draw: full-range int64s make every byte uniform on 0..255
    n_words = -(-x.numel() // 8)
    words = torch.randint(-(2**63), 2**63 - 1, (n_words,), dtype=torch.int64)
    keep = words.view(torch.uint8)[: x.numel()].view(x.shape) >= threshold
    return x * (keep.to(x.dtype) * (256 / (256 - threshold)))


class Dropout(nn.Module):
    """``nn.Dropout`` with the cheaper CPU mask of ``byte_dropout``."""

    def __init__(self, p: DropRate = 0.5) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return byte_dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
