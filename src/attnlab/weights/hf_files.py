"""Another library's saved model folder (transformers, timm, open_clip, the hub): weights, its JSON
config, renaming tables, and the checks every converter makes (``{ours: (theirs, tensor)}``)."""

from __future__ import annotations

import json
import logging
import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from attnlab.core.errors import CheckpointError, first_line
from attnlab.weights.checkpoint import fit_heads

log = logging.getLogger("attnlab.pretrained")

Mapped = dict[str, tuple[str, Tensor]]  # our name -> (the file's name, tensor)
Renamer = Callable[[str], str | None]
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def renamer(table: Mapping[str, str]) -> Renamer:
    """``name`` renamed by the first key of ``table`` it starts with (``{}``: a layer's number), or None."""
    rules = [(re.compile(re.escape(old).replace(r"\{\}", r"(\d+)")), new) for old, new in table.items()]

    def rename(name: str) -> str | None:
        for pattern, new in rules:
            if m := pattern.match(name):
                return new.format(*m.groups()) + name[m.end() :]
        return None

    return rename


def renamers(table: Mapping[str, str]) -> tuple[Renamer, Renamer]:
    """Renaming by ``table`` (theirs -> ours) and back."""
    return renamer(table), renamer({ours: theirs for theirs, ours in table.items()})


def act_name(act: nn.Module) -> str:
    """The ``act`` an MLP's activation module is configured by (``attnlab.nn.blocks.Activation``)."""
    if not isinstance(act, nn.GELU):
        return "quick_gelu"
    return "gelu_tanh" if act.approximate == "tanh" else "gelu"


def read_json(path: Path) -> dict[str, Any]:
    """A saved model's JSON config; unreadable, or not an object: one ``CheckpointError``."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"model.init_from={path}: not a JSON config ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"model.init_from={path}: not a JSON object")
    return config


def weights_file(source: Path, names: tuple[str, ...] = WEIGHT_FILES, key: str = "model.init_from") -> Path:
    """The file itself, or the first of ``names`` in the folder (each library's own, safetensors first)."""
    if source.is_file():
        return source
    for name in names:
        if (source / name).is_file():
            return source / name
    raise CheckpointError(f"{key}={source}: no weights in it (expected one of {', '.join(names)})")


def read_weights(
    source: Path, names: tuple[str, ...] = WEIGHT_FILES, key: str = "model.init_from"
) -> dict[str, Tensor]:
    """Every tensor of a saved model (a file, or a folder holding one of ``names``) on the CPU: safetensors
    (sharded too) or ``weights_only`` torch files, unwrapped as timm does; errors name ``key``."""
    path = weights_file(source, names, key)
    try:
        if path.name.endswith(".index.json"):
            shards = sorted(set(json.loads(path.read_text(encoding="utf-8"))["weight_map"].values()))
            state = {k: v for shard in shards for k, v in load_file(path.parent / shard).items()}
        elif path.suffix == ".safetensors":
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a corrupt or foreign file: safetensors, json and torch raise several kinds
        if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e).lower().replace(" ", "_"):
            raise CheckpointError(
                f"{key}={path}: a pickle that holds more than tensors, which loading would run "
                "as code (refused; save the model as safetensors or a plain state dict)"
            ) from e
        raise CheckpointError(f"{key}={path}: not a readable weights file ({first_line(e)})") from e
    for wrapper in ("state_dict", "model"):  # a training script's checkpoint around the weights
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
            break
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{key}={path}: holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def read_folder(source: Path, model_types: tuple[str, ...], ours: str, **expected: tuple[Any, str]) -> dict:
    """``source``'s ``config.json`` (``{}`` without one), refused unless it describes one of
    ``model_types`` with each ``expected`` key's value (``key=(value, what would fix it)``)."""
    weights_file(source)  # a folder without weights says so before what its config lacks
    path = (source if source.is_dir() else source.parent) / "config.json"
    config = read_json(path) if path.is_file() else {}
    if (kind := config.get("model_type")) is not None and kind not in model_types:
        saved = ", ".join(config.get("architectures") or []) or kind
        raise CheckpointError(
            f"model.init_from={source}: config.json describes a {kind} model ({saved}); "
            f"a {ours} loads {' or '.join(model_types)}"
        )
    for key, (value, fix) in expected.items():
        if key in config and config[key] != value:
            raise CheckpointError(f"model.init_from={source}: config.json's {key} is {config[key]!r}; {fix}")
    return config


def load_mapped(
    module: nn.Module, mapped: Mapped, source: Path, fresh: tuple[str, ...] = (), what: str = ""
) -> None:
    """Copy ``mapped`` into ``module``, every tensor fitting but those under ``fresh`` (heads: left new, with
    a notice); the first that does not fit is one ``CheckpointError``."""
    own = module.state_dict()
    state = {name: value for name, (_, value) in mapped.items()}
    resized, missing, _ = fit_heads(state, own, fresh)
    for name, ours in own.items():
        if name not in state:
            raise CheckpointError(f"model.init_from={source}: no tensor for the model's {name}")
        if state[name].shape != ours.shape:
            raise CheckpointError(
                f"model.init_from={source}: {mapped[name][0]} is {tuple(state[name].shape)} but the model's "
                f"{name} is {tuple(ours.shape)} (configure the net as the checkpoint's config.json)"
            )
    module.load_state_dict({name: state[name].to(ours.dtype) for name, ours in own.items()})
    if resized or missing:
        sizes = [
            f"{k} ({mapped[k][0]} is {tuple(mapped[k][1].shape)}, the model's {tuple(own[k].shape)})"
            for k in resized
        ]
        log.warning(
            "%s: %s re-initialised (not in the checkpoint, or of another size): %s",
            source,
            what,
            ", ".join(missing + sizes),
        )
    log.info("weights loaded from %s", source)


def write_folder(out_dir: Path, config: dict[str, Any], state: dict[str, Tensor]) -> None:
    """``config.json`` and ``model.safetensors`` (contiguous copies: safetensors refuses views)."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(
        {k: v.detach().cpu().contiguous().clone() for k, v in state.items()},
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
