"""Optimizer and scheduler wiring shared by the tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings; leave biases and norm gains alone (as nanoGPT, timm)."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizers(
    module: nn.Module,
    optimizer: Callable[..., torch.optim.Optimizer],
    scheduler: Callable[..., Any] | None,
    weight_decay: float,
) -> dict[str, Any]:
    opt = optimizer(param_groups(module, weight_decay))
    if scheduler is None:
        return {"optimizer": opt}
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(opt), "interval": "step"}}
