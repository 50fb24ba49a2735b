"""Learning-rate schedules as picklable multipliers for ``LambdaLR``.

Being plain objects (not lambdas), their state saves into checkpoints and loads with
``weights_only=True``.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine:
    """Linear warm-up to the base lr, then cosine decay to ``min_lr_ratio`` x base lr (nanoGPT)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> None:
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if step > self.total_steps:
            return self.min_lr_ratio
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + coeff * (1.0 - self.min_lr_ratio)


def warmup_cosine(
    optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> LambdaLR:
    """``LambdaLR`` stepping ``WarmupCosine`` once per optimizer step."""
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))
