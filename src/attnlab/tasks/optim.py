"""Optimizer and scheduler wiring shared by the tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
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


def clip_gradients(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    clip_val: float | None,
    algorithm: str | None,
) -> None:
    """Lightning's clipping, also for fused optimizers when no gradient scaler is involved.

    Lightning refuses to clip for a fused optimizer under any mixed precision, because with
    fp16 the gradients are still scaled; in bf16 and fp32 they are not, and clipping is safe.
    """
    scaler = getattr(module.trainer.precision_plugin, "scaler", None)
    if clip_val and scaler is None and algorithm in (None, "norm"):
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip_val, foreach=True)
    else:
        module.clip_gradients(optimizer, clip_val, algorithm)
