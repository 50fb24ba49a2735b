"""Optimizer and scheduler wiring shared by the tasks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from attnlab.errors import ConfigError
from attnlab.utils.config import constructor_errors

log = logging.getLogger(__name__)


def no_weight_decay(module: nn.Module) -> set[str]:
    """Names (relative to ``module``) of the parameters its submodules exclude from weight decay
    through a timm-style ``no_weight_decay()`` (position tables, class tokens, ...)."""
    names: set[str] = set()
    for prefix, m in module.named_modules():
        declared = getattr(m, "no_weight_decay", None)
        if callable(declared):
            names |= {f"{prefix}.{n}" if prefix else n for n in declared()}
    return names


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings; leave biases, norm gains and what the model declares in
    ``no_weight_decay()`` alone (as nanoGPT, timm)."""
    excluded = no_weight_decay(module)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.dim() >= 2 and n not in excluded]
    no_decay = [p for n, p in named if p.dim() < 2 or n in excluded]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizers(
    module: nn.Module,
    optimizer: Callable[..., torch.optim.Optimizer],
    scheduler: Callable[..., Any] | None,
    weight_decay: float,
    grad_scaler: bool = False,
) -> dict[str, Any]:
    """The configured optimizer (and scheduler) for ``module``.

    Range errors the constructors raise (torch's ``ValueError("Invalid learning rate: -1.0")``)
    become a ``ConfigError`` naming the config node; the types were checked before the run.
    With a gradient scaler (``16-mixed``) a fused optimizer is built unfused: it would unscale
    the gradients inside its step, after Lightning clips them, and Lightning refuses that.
    """
    with constructor_errors("model.optimizer"):
        opt = optimizer(param_groups(module, weight_decay))
        if grad_scaler and opt.defaults.get("fused"):
            log.info(
                "model.optimizer.fused=true -> false: 16-mixed scales the gradients, and they are "
                "unscaled before clipping only for an unfused optimizer"
            )
            opt = optimizer(param_groups(module, weight_decay), fused=False)
    if scheduler is None:
        return {"optimizer": opt}
    with constructor_errors("model.scheduler"):
        sched = scheduler(opt)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def clip_gradients(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    clip_val: float | None,
    algorithm: str | None,
) -> None:
    """Lightning's clipping, also for fused optimizers when no gradient scaler is involved, and
    by the norm of the whole gradient under FSDP.

    Lightning refuses to clip for a fused optimizer under any mixed precision, because with
    fp16 the gradients are still scaled; in bf16 and fp32 they are not, and clipping is safe.
    Under FSDP (``trainer=fsdp``) each process holds a shard of the gradient: its root module's
    ``clip_grad_norm_`` reduces the norm over all of them (a plain ``clip_grad_norm_`` would
    clip each shard by its own norm). FSDP2's parameters are DTensors, whose norm is global.
    """
    if not clip_val:
        return
    scaler = getattr(module.trainer.precision_plugin, "scaler", None)
    sharded = getattr(module.trainer.strategy, "model", None)
    if isinstance(sharded, FullyShardedDataParallel):
        if algorithm not in (None, "norm"):
            raise ConfigError(
                f"trainer.gradient_clip_algorithm={algorithm!r}: under trainer=fsdp gradients are "
                "clipped by their norm only (gradient_clip_algorithm=norm)"
            )
        sharded.clip_grad_norm_(clip_val)  # under 16-mixed Lightning has unscaled them already
    elif scaler is None and algorithm in (None, "norm"):
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip_val, foreach=True)
    else:
        module.clip_gradients(optimizer, clip_val, algorithm)
