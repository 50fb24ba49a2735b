"""Which ``_target_``s a config read from a run folder may name (it is input, not code): attnlab's,
torch.nn/optim's, timm's, and the Lightning, Optuna and Hydra parts the recipes use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from attnlab.core.errors import ConfigError

# the functions and plain classes the recipes name as a _target_ (the other classes are allowed by
# their package and base class)
ALLOWED_CALLABLES = frozenset(
    {
        "attnlab.training.callbacks.ema_with_warmup",
        "attnlab.training.distillation.HardDistillation",
        "attnlab.training.distillation.load_teacher",
        "attnlab.training.optim.Optimization",
        "attnlab.training.schedules.warmup_cosine",
        "attnlab.core.distributed.module_classes",
        "attnlab.data.sources.Builtin",
        "attnlab.data.sources.CaptionShards",
        "attnlab.data.sources.Captions",
        "attnlab.data.sources.Files",
        "attnlab.data.sources.Folder",
        "attnlab.data.sources.Generated",
        "attnlab.data.sources.Pairs",
        "attnlab.data.sources.Shards",
        "attnlab.data.sources.SplitFiles",
        "attnlab.data.sources.StreamedShards",
        "torch.optim.swa_utils.get_ema_multi_avg_fn",
    }
)


# each package whose classes a run folder may build, and the classes they must derive from
BASES = {
    "attnlab": (  # its nets, tasks, data, callbacks and loggers
        "torch.nn.Module",
        "lightning.pytorch.LightningDataModule",
        "lightning.pytorch.Callback",
        "lightning.pytorch.loggers.Logger",
        "hydra.experimental.callback.Callback",
    ),
    "torch.nn": ("torch.nn.Module",),
    "torch.optim": ("torch.optim.Optimizer", "torch.optim.lr_scheduler.LRScheduler"),
    "timm": ("torch.nn.Module",),
    "lightning.pytorch": (
        "lightning.pytorch.Trainer",
        "lightning.pytorch.Callback",
        "lightning.pytorch.loggers.Logger",
        "lightning.pytorch.strategies.Strategy",
    ),
    "optuna": ("optuna.samplers.BaseSampler", "optuna.pruners.BasePruner"),
    **dict.fromkeys(  # a sweep's launcher and sweeper
        ("hydra", "hydra_plugins"),
        (
            "hydra.plugins.launcher.Launcher",
            "hydra.plugins.sweeper.Sweeper",
            "hydra.experimental.callback.Callback",
        ),
    ),
}


def _package(name: str) -> str | None:
    return next((p for p in BASES if name == p or name.startswith(p + ".")), None)


def is_allowed(target: str) -> bool:
    """Whether ``target`` names an allowed class or function, defined in the package its name starts with
    (only allowed packages are imported to find out)."""
    package = _package(target)
    if package is None:
        return False
    try:
        obj = get_object(target)
    except Exception:  # not importable: a missing _target_ is the constructor's error to report
        return True
    name = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
    if name in ALLOWED_CALLABLES:
        return True
    home = _package(getattr(obj, "__module__", None) or "")
    return (
        isinstance(obj, type) and home == package and issubclass(obj, tuple(map(get_object, BASES[package])))
    )


def targets(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """Every ``(key, _target_)`` in a config node, nested dicts and lists included."""
    if isinstance(node, DictConfig | dict):
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items()
        for k, v in items:
            sub = f"{key}.{k}" if key else str(k)
            if k == "_target_":
                yield sub, v
            else:
                yield from targets(v, sub)
    elif isinstance(node, ListConfig | list | tuple):
        for i, v in enumerate(node):
            yield from targets(v, f"{key}[{i}]" if key else f"[{i}]")


def target_nodes(node: Any, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """Every ``_target_`` node under ``node`` (itself included) with its dotted path, interpolations
    unresolved; a node's children are read after the caller has seen it (and maybe renamed them)."""
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
        if "_target_" in node:
            yield path, node
        for key in list(node.keys()):
            child = node._get_node(key)
            if isinstance(child, DictConfig | ListConfig):
                yield from target_nodes(child, f"{path}.{key}" if path else str(key))
    elif isinstance(node, ListConfig) and not node._is_none() and not node._is_missing():
        for i in range(len(node)):
            yield from target_nodes(node._get_node(i), f"{path}[{i}]")


def check_targets(config: Any, source: str, key: str = "") -> None:
    """Refuse, in one line naming the key, the target and ``source`` (the file the config came
    from), any ``_target_`` in ``config`` that is not allowed, before anything is built from it."""
    if isinstance(config, DictConfig | ListConfig):
        config = OmegaConf.to_container(config, resolve=False)
    for where, target in targets(config, key):
        if not isinstance(target, str) or not is_allowed(target):
            raise ConfigError(
                f"{where}={target!r} in {source} is not allowed: a config read from a run folder may "
                "build only attnlab's classes, torch.nn and torch.optim modules, timm models and the "
                "Lightning, Optuna and Hydra parts the recipes use; nothing was run"
            )
