"""What every task shares: the net, its optimizer and schedule, compiling, clipping, train logging."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import lightning as L
import torch
from torch import Tensor, nn

from attnlab.core.errors import CheckpointError, ConfigError
from attnlab.nn import TransformerBlock
from attnlab.training.optim import build_optimizers, clip_gradients
from attnlab.training.optim import freeze as freeze_parameters
from attnlab.weights.checkpoint import check_fits, is_run_checkpoint, load_checkpoint, resolve_pretrained

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

# model.compile: what torch.compile compiles: nothing, the whole net, or each repeated block
CompileScope = bool | Literal["regional"]
# model.compile_mode: torch.compile's mode ("reduce-overhead": CUDA graphs, for small models on a GPU)
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def load_initial_weights(net: nn.Module, spec: str | Mapping[str, str]) -> None:
    """``model.init_from``: copy the weights ``spec`` names into ``net``.

    One of our runs' checkpoints gives its whole net, or only its encoder where the heads differ
    (a pre-trained BERT into a classifier), or the part of it that the net is (a CLIP's image
    tower into a classifier or a Flamingo: ``part_prefix``). A head of another size (another
    number of classes) or one the source has none of starts fresh, with a notice, and a head the
    net has none of is left out (a classifier's trunk as a backbone); any other tensor that does
    not fit is refused, named. Another library's saved model goes through its converter
    (``attnlab.weights.pretrained``). A mapping ``{part: spec}`` fills each named part of the net
    (``{vision: vit_scenes, lm: gpt_...}``, a Flamingo's) from its own source, as above.
    """
    if isinstance(spec, Mapping):
        for part, source in spec.items():
            try:
                target = net.get_submodule(str(part))
            except AttributeError:
                names = ", ".join(name for name, _ in net.named_children())
                raise ConfigError(
                    f"model.init_from.{part}: the net has no such part (its parts: {names})"
                ) from None
            load_initial_weights(target, str(source))
        return
    if not is_run_checkpoint(spec):
        from attnlab.weights.pretrained import load_pretrained

        load_pretrained(net, spec)
        refuse_non_finite(net, spec)
        return
    path = resolve_pretrained(spec, Path("logs"))
    saved = load_checkpoint(path)["state_dict"]
    state = {k.removeprefix("net."): v for k, v in saved.items() if k.startswith("net.")}
    target = net
    if state.keys() != net.state_dict().keys() and isinstance(getattr(net, "encoder", None), nn.Module):
        state = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
        target = net.encoder
    elif prefix := part_prefix(state, net):
        log.info("model.init_from: the net is %s's %s (the rest of that net left out)", path, prefix[:-1])
        state = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    own = target.state_dict()
    fresh = [k for k, v in state.items() if k.startswith("head") and k in own and v.shape != own[k].shape]
    if fresh:
        log.info("model.init_from: %s differ in size from %s's: they start fresh", ", ".join(fresh), path)
        state.update({k: own[k] for k in fresh})
    if missing := [k for k in own if k.startswith("head") and k not in state]:
        log.info("model.init_from: %s has no %s: they start fresh", path, ", ".join(missing))
        state.update({k: own[k] for k in missing})
    if headless := [k for k in state if k.startswith("head") and k not in own]:
        log.info("model.init_from: %s of %s left out (the net has no head)", ", ".join(headless), path)
        state = {k: v for k, v in state.items() if k not in headless}
    check_fits(target, state, f"{path} (model.init_from)")
    target.load_state_dict(state)
    refuse_non_finite(target, path)
    log.info("%s weights loaded from %s", "all" if target is net else "encoder", path)


def refuse_non_finite(net: nn.Module, source: str | Path) -> None:
    """Weights with a NaN or an infinity would train on a NaN loss: refused, naming the source and
    the first such tensor (one pass over the weights, once, at load)."""
    for name, tensor in net.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"model.init_from={source}: {name} holds NaN or infinite values; these weights "
                "cannot be trained from"
            )


def part_prefix(state: Mapping[str, torch.Tensor], net: nn.Module) -> str:
    """The prefix (``image.``) under which a saved net holds every tensor of ``net`` but its head,
    when ``net`` is a part of it (a CLIP's image tower for a classifier or a Flamingo's encoder);
    "" when ``state`` holds them at the top or nowhere."""
    body = [k for k in net.state_dict() if not k.startswith("head")]
    if not body or all(k in state for k in body):
        return ""
    for key in state:
        if key.endswith(f".{body[0]}"):
            prefix = key[: -len(body[0])]
            if all(prefix + k in state for k in body):
                return prefix
    return ""


def repeated_blocks(net: nn.Module) -> list[nn.Module]:
    """The blocks ``model.compile=regional`` compiles one by one: the items of each list of blocks
    in ``net``, innermost lists only (a Swin stage's blocks, not its stages). A list of blocks is
    an ``nn.ModuleList`` (ours) or an ``nn.Sequential`` named ``blocks`` (timm's) whose items are
    modules of one class with parts of their own, other than ``nn.Sequential`` (a conv stem's
    conv-norm-activation runs)."""
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


def check_compile(net: nn.Module, scope: Any, mode: Any) -> None:
    """``model.compile`` and ``model.compile_mode``, refused in one line before anything runs."""
    if not (isinstance(scope, bool) or scope == "regional"):
        raise ConfigError(f"model.compile must be one of false, true, regional, got {scope!r}")
    modes = get_args(CompileMode)
    if mode not in modes:
        raise ConfigError(f"model.compile_mode must be one of {', '.join(modes)}, got {mode!r}")
    if mode != "default" and scope is False:
        raise ConfigError(
            f"model.compile_mode={mode} compiles nothing with model.compile=false: set true or regional"
        )
    if scope == "regional" and not repeated_blocks(net):
        raise ConfigError(
            f"model.compile=regional: {type(net).__name__} has no repeated blocks (a ModuleList of "
            "blocks) to compile one by one; use model.compile=true"
        )


def compile_net(net: nn.Module, scope: CompileScope, mode: CompileMode = "default") -> int:
    """Compile ``net`` in place, so its state dict keeps the eager names (no ``_orig_mod.``):
    whole (``True``) or block by block (``"regional"``, PyTorch's regional compilation: every
    block runs the same ``forward``, so dynamo compiles it once and each block reuses the code,
    the cold start of one block instead of the whole net's). The number of modules compiled."""
    options = {} if mode == "default" else {"mode": mode}
    targets = repeated_blocks(net) if scope == "regional" else [net] if scope else []
    for module in targets:
        module.compile(**options)
    return len(targets)


class Task(L.LightningModule):
    """Base of the tasks: holds ``net`` and builds its optimizer (weight decay on matrices only).

    Args:
        net: the model.
        optimizer: partial optimizer, called with parameter groups.
        scheduler: partial LR scheduler, called with the optimizer; stepped every optimizer step.
        weight_decay: applied to weight matrices and embeddings only (not biases or norms).
        compile: ``torch.compile`` at setup: ``False``; ``True``, the whole net; ``"regional"``,
            each repeated block (``compile_net``), the same code for every block: a shorter cold
            start. Either keeps the state dict's names.
        init_from: weights to start from: one of our runs' checkpoints (or the name of a task
            whose newest run's ``last.ckpt``), or another library's saved model (transformers,
            timm, open_clip: ``attnlab.weights.pretrained``); or ``{part: one of those}`` for
            parts of the net (``load_initial_weights``); ``None``: from scratch.
        lr_decay: layer-wise learning-rate decay for fine-tuning: each block ``lr_decay`` times the
            rate of the one above it, the head at the full rate (``tasks.optim.param_groups``).
        freeze: parameters never trained, as dotted prefixes of their names (``[embed, blocks.0]``).
        compile_mode: ``torch.compile``'s mode; ``"reduce-overhead"`` replays CUDA graphs, which
            cuts the launch cost of a small model's many short kernels on a GPU (none on a CPU).
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        weight_decay: float = 0.0,
        compile: CompileScope = False,
        init_from: str | dict[str, str] | None = None,
        lr_decay: float | None = None,
        freeze: list[str] | None = None,
        compile_mode: CompileMode = "default",
    ) -> None:
        super().__init__()
        check_compile(net, compile, compile_mode)
        self.net = net
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.weight_decay, self.compile_net, self.lr_decay = weight_decay, compile, lr_decay
        self.compile_mode = compile_mode
        if init_from:
            load_initial_weights(net, init_from)
        freeze_parameters(net, list(freeze or []))

    def setup(self, stage: str) -> None:
        if self.compile_net and stage == "fit":  # in place: state_dict keys keep their names
            n = compile_net(self.net, self.compile_net, self.compile_mode)
            if self.compile_net == "regional":
                log.info("model.compile=regional: %d blocks compiled one by one, alike ones sharing code", n)

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

    def log_train_loss(self, loss: Tensor, **kwargs: Any) -> None:
        # loggers only write every log_every_n_steps, and each self.log call has a cost of its
        # own (visible on a small model's step), so log only on the steps that are written
        every = self.trainer.log_every_n_steps
        if every and (self.global_step + 1) % every == 0:
            self.log("train/loss", loss, prog_bar=True, **kwargs)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer else None
        return build_optimizers(
            self,
            self.optimizer_factory,
            self.scheduler_factory,
            self.weight_decay,
            scaler is not None,
            self.lr_decay,
        )
