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
    """Names (relative to ``module``) of the parameters its submodules exclude from weight decay
    through a timm-style ``no_weight_decay()`` (position tables, class tokens, ...)."""
    names: set[str] = set()
    for prefix, m in module.named_modules():
        declared = getattr(m, "no_weight_decay", None)
        if callable(declared):
            names |= {f"{prefix}.{n}" if prefix else n for n in declared()}
    return names


def trunk_blocks(net: nn.Module) -> tuple[str, int]:
    """Where ``net`` keeps its Transformer blocks (the first ``nn.ModuleList`` named ``blocks``:
    ``blocks``, ``encoder.blocks``, ...) and how many there are; ``("", 0)`` for a net without."""
    for name, m in net.named_modules():
        if name.rsplit(".", 1)[-1] == "blocks" and isinstance(m, nn.ModuleList) and len(m):
            return name, len(m)
    return "", 0


def layer_ids(module: nn.Module, blocks: str, depth: int) -> dict[str, int]:
    """Each parameter's depth for layer-wise LR decay (BEiT, timm): 0 for what comes before the
    blocks (embeddings), i + 1 inside block i, depth + 1 after them (final norm, heads)."""
    ids, seen_blocks = {}, False
    for name, _ in module.named_parameters():
        rest = name.split(f"{blocks}.", 1)
        if len(rest) == 2 and rest[1].split(".", 1)[0].isdigit():
            ids[name], seen_blocks = int(rest[1].split(".", 1)[0]) + 1, True
        else:
            ids[name] = depth + 1 if seen_blocks else 0
    return ids


def param_groups(
    module: nn.Module, weight_decay: float, lr_decay: float | None = None
) -> list[dict[str, Any]]:
    """Decay matrices and embeddings; leave biases, norm gains and what the model declares in
    ``no_weight_decay()`` alone (as nanoGPT, timm). With ``lr_decay``, one group per depth too,
    its learning rate scaled by ``lr_decay ** (depth + 1 - layer)`` (``lr_scale``, applied by
    ``Optimization.configure``): the head at the full rate, each block below it ``lr_decay`` times less.
    Frozen parameters (``requires_grad`` off) are in no group."""
    excluded = no_weight_decay(module)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if lr_decay is None:
        ids, depth = dict.fromkeys((n for n, _ in named), 0), -1
    else:
        net = getattr(module, "net", module)
        blocks, depth = trunk_blocks(net)
        prefix = "net." if net is not module else ""
        ids = (
            layer_ids(module, prefix + blocks, depth)
            if blocks
            else dict.fromkeys((n for n, _ in module.named_parameters()), 1)  # no blocks: one depth
        )
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for n, p in named:
        decayed = p.dim() >= 2 and n not in excluded
        group = groups.setdefault(
            (ids[n], decayed),
            {"params": [], "weight_decay": weight_decay if decayed else 0.0, "lr_scale": 1.0},
        )
        if lr_decay is not None:
            group["lr_scale"] = lr_decay ** (depth + 1 - ids[n])
        group["params"].append(p)
    if lr_decay is None:  # the two groups, decayed first, even when one is empty
        return [
            groups.get((0, True), {"params": [], "weight_decay": weight_decay, "lr_scale": 1.0}),
            groups.get((0, False), {"params": [], "weight_decay": 0.0, "lr_scale": 1.0}),
        ]
    return [groups[k] for k in sorted(groups)]


def freeze(net: nn.Module, patterns: list[str]) -> None:
    """Turn off the gradients of the parameters under each pattern, a dotted prefix of their
    names in ``net`` or in the module holding its blocks (``embed``, ``blocks.0``, ``encoder.embed``).
    A pattern that names nothing is a ``ConfigError``."""
    blocks, _ = trunk_blocks(net)
    trunk = blocks.rpartition(".")[0]
    for pattern in patterns:
        hits = [
            p
            for name, p in net.named_parameters()
            if any(
                f"{name}.".startswith(f"{where}{pattern}.") for where in ("", f"{trunk}." if trunk else "")
            )
        ]
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
    """``model.optim``: how every task trains its net.

    Args:
        optimizer: partial optimizer, called with the parameter groups (``param_groups``).
        scheduler: partial LR scheduler, called with the optimizer; stepped every optimizer step.
        weight_decay: on weight matrices and embeddings only (not biases, norms, ``no_weight_decay()``).
        lr_decay: layer-wise learning-rate decay for fine-tuning: each block ``lr_decay`` times the
            rate of the one above it, the head at the full rate; ``None``: one rate.
        freeze: parameters never trained, as dotted prefixes of their names (``[embed, blocks.0]``).
        compile: ``torch.compile`` at setup: ``False``; ``True``, the whole net; ``"regional"``,
            each repeated block, the same code for every block: a shorter cold start. Either keeps
            the state dict's names (``attnlab.training.base.compile_net``).
        compile_mode: ``torch.compile``'s mode; ``"reduce-overhead"`` replays CUDA graphs, which
            cuts the launch cost of a small model's many short kernels on a GPU (none on a CPU).
    """

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
        self.weight_decay, self.lr_decay, self.freeze = weight_decay, lr_decay, list(freeze or [])
        self.compile, self.compile_mode = compile, compile_mode

    def configure(self, module: nn.Module, grad_scaler: bool = False) -> dict[str, Any]:
        """The optimizer (and scheduler) for ``module``, as Lightning's ``configure_optimizers``
        returns them.

        Range errors the constructors raise (torch's ``ValueError("Invalid learning rate: -1.0")``)
        become a ``ConfigError`` naming the config node; the types were checked before the run.
        With a gradient scaler (``16-mixed``) a fused optimizer is built unfused: it would unscale
        the gradients inside its step, after Lightning clips them, and Lightning refuses that.
        Each group's rate is scaled by its ``lr_scale`` (``lr_decay``) before the scheduler takes
        the rates as its base rates.
        """
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
