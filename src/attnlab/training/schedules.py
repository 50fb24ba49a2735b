"""Learning-rate schedules as picklable multipliers for ``LambdaLR`` (saved in checkpoints,
``weights_only`` loads)."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from attnlab.core.errors import ConfigError
from attnlab.core.specs import is_int, is_number


def check_steps(name: str, value: int, low: int) -> None:
    """``model.optim.scheduler.<name>`` must be an integer >= ``low``."""
    if not is_int(value) or value < low:
        bound = "a non-negative" if low == 0 else "a positive"
        why = ""
        if name == "total_steps":  # it follows trainer.max_steps unless set, and -1 there means "no limit"
            why = " (set it, or model.optim.scheduler=null, when trainer.max_steps=-1)"
        raise ConfigError(f"model.optim.scheduler.{name}={value!r}: must be {bound} integer{why}")


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
    check_steps("warmup_steps", warmup_steps, 0)
    check_steps("total_steps", total_steps, 1)
    if not is_number(min_lr_ratio) or not 0 <= min_lr_ratio <= 1:
        raise ConfigError(f"model.optim.scheduler.min_lr_ratio={min_lr_ratio!r}: must be in [0, 1]")
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))


class WarmupInverseSqrt:
    """Linear warm-up to the base lr, then 1/sqrt(step) (the Transformer paper's "Noam" with base lr
    (d_model * warmup_steps)^-0.5)."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        step += 1
        return min(step / self.warmup_steps, (self.warmup_steps / step) ** 0.5)


def warmup_inverse_sqrt(optimizer: Optimizer, warmup_steps: int) -> LambdaLR:
    """``LambdaLR`` stepping ``WarmupInverseSqrt`` once per optimizer step."""
    check_steps("warmup_steps", warmup_steps, 1)  # the decay divides by it
    return LambdaLR(optimizer, WarmupInverseSqrt(warmup_steps))
