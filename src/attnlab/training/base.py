"""What every task shares: the net, its optimizer and schedule, compiling, clipping, train logging."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics import MaxMetric, Metric, MinMetric

from attnlab.core.errors import ConfigError
from attnlab.core.specs import LoRA
from attnlab.nn import TransformerBlock
from attnlab.training.lora import train_adapters, weights_before
from attnlab.training.optim import CompileMode, CompileScope, Optimization, clip_gradients, freeze
from attnlab.weights.init import load_init

# Methods that tasks and callbacks call on a net besides ``forward``, the same number of times on
# every process. Under FSDP2 a sharded module gathers its parameters only around registered
# methods. Decoding (start/step, generate) runs a different number of steps on each process and
# gathers everything once instead (``attnlab.core.distributed.unsharded``).
ENTRY_POINTS = (
    "forward_heads",
    "forward_features",
    "forward_head",
    "patch_attention",
    "attention_maps",
    "alignments",
    "encode_image",
    "encode_text",
    "scale",
    "encode",
    "decode",
    "logits",
)


log = logging.getLogger(__name__)


def repeated_blocks(net: nn.Module) -> list[nn.Module]:
    """The blocks ``compile=regional`` compiles one by one: the items of each innermost list of blocks (a
    ``ModuleList``, or timm's ``Sequential`` ``blocks``) of one class with parts of their own."""
    lists = [m for name, m in net.named_modules() if _lists_blocks(name, m)]
    inner = [m for m in lists if not any(o is not m and any(o is x for x in m.modules()) for o in lists)]
    return [block for blocks in inner for block in blocks]


def _lists_blocks(name: str, module: nn.Module) -> bool:
    if isinstance(module, nn.Sequential):
        if name.rsplit(".", 1)[-1] != "blocks" or len(module) < 2:
            return False
    elif not isinstance(module, nn.ModuleList) or not len(module):
        return False
    first = module[0]
    return (
        not isinstance(first, nn.Sequential)
        and all(type(m) is type(first) for m in module)
        and next(first.children(), None) is not None
    )


def check_compile(net: nn.Module, scope: CompileScope) -> None:
    """``model.optim.compile=regional`` needs repeated blocks to compile one by one."""
    if scope == "regional" and not repeated_blocks(net):
        raise ConfigError(
            f"model.optim.compile=regional: {type(net).__name__} has no repeated blocks (a ModuleList "
            "of blocks) to compile one by one; use model.optim.compile=true"
        )


def compile_net(net: nn.Module, scope: CompileScope, mode: CompileMode = "default") -> int:
    """Compile ``net`` in place (state dict names kept): whole, or block by block (``"regional"``: one
    compile reused by alike blocks); the number of modules compiled."""
    options = {} if mode == "default" else {"mode": mode}
    targets = repeated_blocks(net) if scope == "regional" else [net] if scope else []
    for module in targets:
        module.compile(**options)
    return len(targets)


class Task(L.LightningModule):
    """Base of the tasks: trains ``net`` as ``optim`` says, from ``init_from``'s weights (``load_init``)
    with ``lora`` adapters (``attnlab.training.lora``: only they train) when set."""

    items = "samples"  # what ``step_work`` counts, named in ``throughput/<items>_per_sec``

    def __init__(
        self,
        net: nn.Module,
        optim: Optimization,
        init_from: str | dict[str, str] | None = None,
        lora: LoRA | None = None,
    ) -> None:
        super().__init__()
        check_compile(net, optim.compile)
        self.net, self.optim = net, optim
        before = weights_before(net) if lora and init_from else None  # to tell what init_from fills
        if init_from:
            load_init(net, init_from)
        if lora:
            train_adapters(net, lora, before)
        freeze(net, optim.freeze)

    def setup(self, stage: str) -> None:
        if self.optim.compile and stage == "fit":  # in place: state_dict keys keep their names
            n = compile_net(self.net, self.optim.compile, self.optim.compile_mode)
            if self.optim.compile == "regional":
                log.info("model.optim.compile=regional: %d blocks compiled, alike ones sharing code", n)

    def configure_model(self) -> None:
        """FSDP2 (``trainer=fsdp2``, Lightning's ``ModelParallelStrategy``): every Transformer
        block is sharded on its own, the rest of the net together; other strategies: nothing."""
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

        if isinstance(self.net, FSDPModule):  # sharded by an earlier fit in this process
            return
        mesh = self.device_mesh["data_parallel"]
        for module in self.net.modules():
            if isinstance(module, TransformerBlock):
                fully_shard(module, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        for name in ENTRY_POINTS:
            if callable(getattr(self.net, name, None)):
                register_fsdp_forward_method(self.net, name)
        self.to(self.trainer.strategy.root_device)  # what is not sharded (a distillation teacher)

    def logs_this_step(self) -> bool:
        # loggers only write every log_every_n_steps, and each self.log call has a cost of its
        # own (visible on a small model's step), so log only on the steps that are written
        every = self.trainer.log_every_n_steps
        return bool(every) and (self.global_step + 1) % every == 0

    def log_best(self, name: str, best: Metric, value: Tensor) -> None:
        """Log ``val/<name>_best``: ``best`` updated with ``value`` (not at the sanity check)."""
        if not self.trainer.sanity_checking:
            best.update(value)
            self.log(f"val/{name}_best", best.compute())

    def log_loss(self, key: str, metric: Metric, prog_bar: bool = False) -> Tensor:
        """Log ``metric``'s loss as ``key`` and its exp as the same key with ``ppl`` for ``loss``; reset it.
        compute() sums the states over the processes: global values, no sync_dist needed."""
        loss = metric.compute()
        metric.reset()
        self.log(key, loss, prog_bar=prog_bar)
        self.log(key.replace("loss", "ppl"), torch.exp(loss))
        return loss

    def figure_path(self, name: str) -> Path | None:
        """``<plot_dir>/<name>``, or None without a ``plot_dir``."""
        plot_dir = getattr(self, "plot_dir", None)
        return Path(plot_dir) / name if plot_dir else None

    def write_lines(self, name: str, lines: list[str]) -> Path:
        """Write ``lines`` to ``<run folder>/<name>``, one a line."""
        path = Path(self.trainer.default_root_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return path

    def train_loss(self, batch: Any) -> Tensor:
        """The loss ``training_step`` logs and returns."""
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.train_loss(batch)
        if self.logs_this_step():
            self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer else None
        return self.optim.configure(self, grad_scaler=scaler is not None)


def best_so_far(mode: Literal["min", "max"]) -> Metric:
    """The best validation value seen, kept in checkpoints (a resumed run goes on from it)."""
    best = MinMetric() if mode == "min" else MaxMetric()
    best.persistent(True)
    return best


def gather_objects(items: list[Any]) -> list[Any]:
    """Every process's ``items``, concatenated (each process gets all); a collective call under DDP."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(items)
    parts: list[list[Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part or []]
