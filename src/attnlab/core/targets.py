"""Which ``_target_``s a config read from a run folder (a checkpoint's saved config, a sweep's saved
overrides) may name, checked before anything in it is instantiated.

Hydra instantiates whatever a ``_target_`` names; its own blocklist stops ``os.system`` and the
like but not ``torch.load`` on a pickle beside the checkpoint, ``builtins.open(path, "w")`` or
``shutil.copy``. A run folder handed on by a colleague is input, not code: its configs may build
attnlab's own classes, ``torch.nn`` modules, ``torch.optim`` optimizers and schedules, timm's
modules, the Lightning, Optuna and Hydra parts the recipes configure, and the few functions below.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

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


def _bases(package: str) -> tuple[type, ...]:
    """The classes a package's allowed classes must derive from."""
    if package == "attnlab":  # its nets, tasks, data, callbacks and loggers
        import lightning.pytorch as pl
        from hydra.experimental.callback import Callback as HydraCallback
        from lightning.pytorch.loggers import Logger
        from torch import nn

        return (nn.Module, pl.LightningDataModule, pl.Callback, Logger, HydraCallback)
    if package in ("torch.nn", "timm"):
        from torch import nn

        return (nn.Module,)
    if package == "torch.optim":
        import torch

        return (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    if package == "lightning.pytorch":
        import lightning.pytorch as pl
        from lightning.pytorch.loggers import Logger
        from lightning.pytorch.strategies import Strategy

        return (pl.Trainer, pl.Callback, Logger, Strategy)
    if package in ("hydra", "hydra_plugins"):  # a sweep's launcher and sweeper
        from hydra.experimental.callback import Callback as HydraCallback
        from hydra.plugins.launcher import Launcher
        from hydra.plugins.sweeper import Sweeper

        return (Launcher, Sweeper, HydraCallback)
    import optuna  # "optuna"

    return (optuna.samplers.BaseSampler, optuna.pruners.BasePruner)


PACKAGES = (
    "attnlab",
    "torch.nn",
    "torch.optim",
    "timm",
    "lightning.pytorch",
    "optuna",
    "hydra",
    "hydra_plugins",
)


def _package(name: str) -> str | None:
    return next((p for p in PACKAGES if name == p or name.startswith(p + ".")), None)


def _locate(target: str) -> Any:
    """``target`` imported as Hydra would: the longest importable module prefix, then attributes."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(target)


def is_allowed(target: str) -> bool:
    """Whether ``target`` names an allowed class or function. Only the allowed packages are
    imported to find out, and the object found must be defined in the package its name starts
    with (``attnlab.weights.checkpoint.torch.load`` is torch's ``load``, and refused)."""
    package = _package(target)
    if package is None:
        return False
    try:
        obj = _locate(target)
    except Exception:  # not importable: a missing _target_ is the constructor's error to report
        return True
    name = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
    if name in ALLOWED_CALLABLES:
        return True
    home = _package(getattr(obj, "__module__", None) or "")
    return isinstance(obj, type) and home == package and issubclass(obj, _bases(package))


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


# where attnlab's classes moved when its packages took their layers (issue 58): a run saved before
# names them the old way, and is read the new way (``translate_moved``)
MOVED = {
    "attnlab.tasks.": "attnlab.training.",
    "attnlab.callbacks.": "attnlab.training.callbacks.",
    "attnlab.loggers.": "attnlab.training.loggers.",
    "attnlab.utils.": "attnlab.core.",
}


def translate_moved(config: DictConfig) -> list[str]:
    """Rewrite, in place, every ``_target_`` under ``config`` that names a module by its place
    before issue 58; return the moves applied (``attnlab.tasks.* -> attnlab.training.*``)."""
    done: dict[str, None] = {}
    nodes: list[Any] = [config]
    while nodes:
        node = nodes.pop()
        if isinstance(node, DictConfig):
            target = node.get("_target_") if "_target_" in node else None
            old = next((o for o in MOVED if isinstance(target, str) and target.startswith(o)), None)
            if old is not None:
                node["_target_"] = MOVED[old] + target.removeprefix(old)
                done[f"{old}* -> {MOVED[old]}*"] = None
            nodes.extend(v for k, v in node.items_ex(resolve=False) if k != "_target_")
        elif isinstance(node, ListConfig):
            nodes.extend(node)
    return list(done)


# the task's optimisation keys, moved into one spec (issue 58): model.<key> -> model.optim.<key>;
# refused on the command line (``attnlab.core.config``), translated in a saved run's config
MOVED_KEYS = {
    f"model.{k}": f"model.optim.{k}"
    for k in ("optimizer", "scheduler", "weight_decay", "lr_decay", "freeze", "compile", "compile_mode")
}
# the data keys that moved into data.source, data.mixup and data.normalize (issue 58); val_size,
# which some DataModules still take (ImageFiles': data.source.val_size), is left to its signature
SOURCE_KEYS = ("on_bad_record", "shuffle_batches", "fit_captions", "url", "sha256", "images_dir", "image_key")
MOVED_KEYS |= {f"data.{k}": f"data.source.{k}" for k in (*SOURCE_KEYS, "caption_key")}
MOVED_KEYS |= {f"data.{k}": "data.source.path" for k in ("shards_dir", "pairs_file", "captions_file")}
MOVED_KEYS |= {"data.files": "data.source.names", "data.synthetic_size": "data.source.train_size"}
MOVED_KEYS |= {
    f"data.{k}": f"data.source.{k}" for k in ("data_dir", "cache_dir", "train_file", "val_file", "test_file")
}
MOVED_KEYS |= {f"data.{k}": f"data.normalize.{k}" for k in ("mean", "std")}
MOVED_KEYS |= {f"data.{k}": f"data.mixup.{k}" for k in ("mixup_alpha", "cutmix_alpha")}
MOVED_KEYS |= {"data.mixup_prob": "data.mixup.prob", "data.mixup_switch_prob": "data.mixup.switch_prob"}


def moved_key(key: str) -> str | None:
    """The new name of ``key`` (``model.optimizer.lr`` -> ``model.optim.optimizer.lr``), or None."""
    old = next((o for o in MOVED_KEYS if key == o or key.startswith(o + ".")), None)
    return None if old is None else MOVED_KEYS[old] + key[len(old) :]


def translate_moved_keys(model: DictConfig) -> list[str]:
    """Move a saved run's optimisation keys (``model.weight_decay``) into ``model.optim``, in
    place; return the move (none: empty)."""
    old = [k for k in map(str, model.keys()) if f"model.{k}" in MOVED_KEYS]
    if not old or "optim" in model:
        return []
    raw = OmegaConf.to_container(model, resolve=False)
    with open_dict(model):
        model.optim = {"_target_": "attnlab.training.optim.Optimization", **{k: raw[k] for k in old}}
        for k in old:
            del model[k]
    return ["model.{" + ",".join(old) + "} -> model.optim.*"]


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
