"""Dropout whose mask costs one random byte per element on CPU, where ``nn.Dropout``'s float
Bernoulli sampling is a visible share of a small model's step (``benchmarks/dropout.py``); elsewhere
(CUDA's fused kernel is fast) ``F.dropout``."""

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
    # p rounded to a multiple of 1/256 (0.2 -> 51/256), the kept scaled by the exact inverse keep
    # probability; p below 1/512 rounds to no dropout at all
    threshold = min(round(p * 256), 255)
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
