"""Optimizer and scheduler wiring shared by the tasks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, Literal

import lightning as L
import torch
from annotated_types import Interval
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from attnlab.core.config import constructor_errors
from attnlab.core.errors import ConfigError

log = logging.getLogger(__name__)


def no_weight_decay(module: nn.Module) -> set[str]:
    """The parameters (names in ``module``) its submodules' timm-style ``no_weight_decay()`` exclude."""
    names: set[str] = set()
    for prefix, m in module.named_modules():
        declared = getattr(m, "no_weight_decay", None)
        if callable(declared):
            names |= {f"{prefix}.{n}" if prefix else n for n in declared()}
    return names


def trunk_blocks(net: nn.Module) -> tuple[str, int]:
    """Where ``net`` keeps its blocks (the first ``ModuleList`` named ``blocks``) and how many."""
    for name, m in net.named_modules():
        if name.rsplit(".", 1)[-1] == "blocks" and isinstance(m, nn.ModuleList) and len(m):
            return name, len(m)
    return "", 0


def layer_ids(module: nn.Module, blocks: str, depth: int) -> dict[str, int]:
    """Each parameter's depth for layer-wise LR decay (BEiT, timm): 0 before the blocks, i + 1 in
    block i, depth + 1 after them."""
    ids: dict[str, int] = {}
    seen_blocks = False
    for name, _ in module.named_parameters():
        rest = name.split(f"{blocks}.", 1)
        if len(rest) == 2 and rest[1].split(".", 1)[0].isdigit():
            ids[name] = int(rest[1].split(".", 1)[0]) + 1
            seen_blocks = True
        else:
            ids[name] = depth + 1 if seen_blocks else 0
    return ids


def param_groups(
    module: nn.Module, weight_decay: float, lr_decay: float | None = None
) -> list[dict[str, Any]]:
    """Decay matrices and embeddings, not biases, norms or ``no_weight_decay()`` (nanoGPT, timm); with
    ``lr_decay`` a group per depth, ``lr_scale`` = lr_decay ** (depth + 1 - layer). Frozen: in none."""
    excluded = no_weight_decay(module)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if lr_decay is None:
        ids = dict.fromkeys((n for n, _ in named), 0)
        depth = -1
    else:
        net = getattr(module, "net", module)
        blocks, depth = trunk_blocks(net)
        prefix = "net." if net is not module else ""
        ids = (
            layer_ids(module, prefix + blocks, depth)
            if blocks
            else dict.fromkeys((n for n, _ in module.named_parameters()), 1)  # no blocks: one depth
        )

    def group(layer: int, decayed: bool) -> dict[str, Any]:
        scale = 1.0 if lr_decay is None else lr_decay ** (depth + 1 - layer)
        return {"params": [], "weight_decay": weight_decay if decayed else 0.0, "lr_scale": scale}

    # without lr_decay: the two groups, decayed first, even when one is empty
    groups = {key: group(*key) for key in ((0, True), (0, False))} if lr_decay is None else {}
    for n, p in named:
        key = (ids[n], p.dim() >= 2 and n not in excluded)
        groups.setdefault(key, group(*key))["params"].append(p)
    return list(groups.values()) if lr_decay is None else [groups[k] for k in sorted(groups)]


def freeze(net: nn.Module, patterns: list[str]) -> None:
    """Turn off the gradients under each pattern (a dotted prefix in ``net`` or in the module holding its
    blocks: ``embed``, ``blocks.0``); a pattern naming nothing is a ``ConfigError``."""
    trunk = trunk_blocks(net)[0].rpartition(".")[0]
    roots = ("", f"{trunk}.") if trunk else ("",)
    for pattern in patterns:
        prefixes = tuple(f"{root}{pattern}." for root in roots)
        hits = [p for name, p in net.named_parameters() if f"{name}.".startswith(prefixes)]
        if not hits:
            names = sorted({n.split(".")[0] for n, _ in net.named_parameters()})
            raise ConfigError(
                f"model.optim.freeze: {pattern!r} names no parameters of the net (a dotted prefix such as "
                f"{', '.join(names)} or blocks.0)"
            )
        for p in hits:
            p.requires_grad_(False)
    if patterns:
        frozen = sum(p.numel() for p in net.parameters() if not p.requires_grad)
        log.info("model.optim.freeze=%s: %d parameters frozen", list(patterns), frozen)


# model.optim.compile: what torch.compile compiles: nothing, the whole net, or each repeated block
CompileScope = bool | Literal["regional"]
# model.optim.compile_mode: torch.compile's mode ("reduce-overhead": CUDA graphs, small models on a GPU)
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# model.optim.lr_decay: each block's rate this times the rate of the one above it
LrDecay = Annotated[float, Interval(gt=0, le=1)]


class Optimization:
    """``model.optim``: optimizer and scheduler (partials), weight decay (matrices and embeddings only),
    layer-wise ``lr_decay``, ``freeze``d prefixes, ``torch.compile`` scope and mode."""

    def __init__(
        self,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        weight_decay: float = 0.0,
        lr_decay: LrDecay | None = None,
        freeze: list[str] | None = None,
        compile: CompileScope = False,
        compile_mode: CompileMode = "default",
    ) -> None:
        if compile_mode != "default" and compile is False:
            raise ConfigError(
                f"model.optim.compile_mode={compile_mode} compiles nothing with model.optim.compile=false: "
                "set true or regional"
            )
        self.optimizer, self.scheduler = optimizer, scheduler
        self.weight_decay, self.lr_decay = weight_decay, lr_decay
        self.freeze = list(freeze or [])
        self.compile, self.compile_mode = compile, compile_mode

    def configure(self, module: nn.Module, grad_scaler: bool = False) -> dict[str, Any]:
        """Lightning's optimizer (and per-step scheduler) for ``module``; under a gradient scaler a fused
        optimizer is built unfused (it would unscale after Lightning clips)."""
        groups = partial(param_groups, module, self.weight_decay, self.lr_decay)
        with constructor_errors("model.optim.optimizer"):
            opt = self.optimizer(groups())
            if grad_scaler and opt.defaults.get("fused"):
                log.info(
                    "model.optim.optimizer.fused=true -> false: 16-mixed scales the gradients, and "
                    "they are unscaled before clipping only for an unfused optimizer"
                )
                opt = self.optimizer(groups(), fused=False)
        for group in opt.param_groups:
            group["lr"] *= group["lr_scale"]
        if self.scheduler is None:
            return {"optimizer": opt}
        with constructor_errors("model.optim.scheduler"):
            sched = self.scheduler(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def clip_gradients(
    module: L.LightningModule, optimizer: torch.optim.Optimizer, clip_val: float | None, algorithm: str | None
) -> None:
    """Lightning's clipping, also for a fused optimizer without a gradient scaler (bf16, fp32 grads are
    unscaled), and by the whole gradient's norm under FSDP (each process holds a shard)."""
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
