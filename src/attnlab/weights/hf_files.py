"""Another library's saved model folder (transformers, timm, open_clip, the hub): weights (safetensors or
``weights_only``), ``config.json``, and the checks every converter makes (``{ours: (theirs, tensor)}``)."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from attnlab.core.errors import CheckpointError

log = logging.getLogger("attnlab.pretrained")

Mapped = dict[str, tuple[str, Tensor]]  # our name -> (the file's name, tensor)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def read_config(source: Path) -> dict[str, Any]:
    """``config.json`` of a saved-model folder (or beside a weights file); ``{}`` when absent."""
    path = (source if source.is_dir() else source.parent) / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from e


def weights_file(source: Path, names: tuple[str, ...] = WEIGHT_FILES, field: str = "model.init_from") -> Path:
    """The weights ``source`` names: the file itself, or the first of ``names`` in the folder
    (each library's own, safetensors first)."""
    if source.is_file():
        return source
    for name in names:
        if (source / name).is_file():
            return source / name
    raise CheckpointError(f"{field}={source}: no weights in it (expected one of {', '.join(names)})")


def read_weights(
    source: Path, names: tuple[str, ...] = WEIGHT_FILES, field: str = "model.init_from"
) -> dict[str, Tensor]:
    """Every tensor of a saved model (a file, or a folder holding one of ``names``) on the CPU: safetensors
    (sharded too) or ``weights_only`` torch files, unwrapped as timm does."""
    path = weights_file(source, names, field)
    try:
        if path.name.endswith(".index.json"):
            shards = sorted(set(json.loads(path.read_text(encoding="utf-8"))["weight_map"].values()))
            state = {k: v for shard in shards for k, v in load_file(path.parent / shard).items()}
        elif path.suffix == ".safetensors":
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as e:
        if not isinstance(e, pickle.UnpicklingError) and "weights_only" not in str(e).lower().replace(
            " ", "_"
        ):
            raise CheckpointError(f"{field}={path}: not a readable weights file ({_first_line(e)})") from e
        raise CheckpointError(
            f"{field}={path}: a pickle that holds more than tensors, which loading would run as code "
            "(refused; save the model as safetensors or a plain state dict)"
        ) from e
    except Exception as e:  # a corrupt or foreign file: safetensors, json and torch raise several kinds
        raise CheckpointError(f"{field}={path}: not a readable weights file ({_first_line(e)})") from e
    for key in ("state_dict", "model"):  # a training script's checkpoint around the weights
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{field}={path}: holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or ["no details"])[0][:200]


def require_architecture(
    config: dict[str, Any], source: Path, model_types: tuple[str, ...], ours: str
) -> None:
    """Refuse a ``config.json`` that describes another kind of model than ``model_types``."""
    kind = config.get("model_type")
    if kind is not None and kind not in model_types:
        saved = ", ".join(config.get("architectures") or []) or kind
        raise CheckpointError(
            f"model.init_from={source}: config.json describes a {kind} model ({saved}); "
            f"a {ours} loads {' or '.join(model_types)}"
        )


def require_value(config: dict[str, Any], source: Path, key: str, expected: Any, fix: str) -> None:
    """Refuse a ``config.json`` value ours cannot reproduce (``fix`` says what would)."""
    if key in config and config[key] != expected:
        raise CheckpointError(f"model.init_from={source}: config.json's {key} is {config[key]!r}; {fix}")


def read_folder(source: Path, model_types: tuple[str, ...], ours: str, **expected: tuple[Any, str]) -> dict:
    """``source``'s ``config.json``, refused unless it describes one of ``model_types`` with each
    ``expected`` key's value (``key=(value, what would fix it)``)."""
    weights_file(source)  # a folder without weights says so before what its config lacks
    config = read_config(source)
    require_architecture(config, source, model_types, ours)
    for key, (value, fix) in expected.items():
        require_value(config, source, key, value, fix)
    return config


def load_mapped(
    module: nn.Module, mapped: Mapped, source: Path, fresh: tuple[str, ...] = (), what: str = ""
) -> None:
    """Copy ``mapped`` into ``module``, every tensor fitting but those under ``fresh`` (heads: left new, with
    a notice); the first that does not fit is one ``CheckpointError``."""
    kept: list[str] = []
    state = {}
    for name, ours in module.state_dict().items():
        head = name.startswith(fresh) if fresh else False
        if name not in mapped:
            if head:
                kept.append(name)
                continue
            raise CheckpointError(f"model.init_from={source}: no tensor for the model's {name}")
        theirs, value = mapped[name]
        if value.shape != ours.shape:
            if head:
                kept.append(f"{name} ({theirs} is {tuple(value.shape)}, the model's {tuple(ours.shape)})")
                continue
            raise CheckpointError(
                f"model.init_from={source}: {theirs} is {tuple(value.shape)} but the model's {name} is "
                f"{tuple(ours.shape)} (configure the net as the checkpoint's config.json)"
            )
        state[name] = value.to(ours.dtype)
    module.load_state_dict(state, strict=False)
    if kept:
        log.warning(
            "%s: %s re-initialised (not in the checkpoint, or of another size): %s",
            source,
            what,
            ", ".join(kept),
        )
    log.info("weights loaded from %s", source)


def write_folder(out_dir: Path, config: dict[str, Any], state: dict[str, Tensor]) -> None:
    """``config.json`` and ``model.safetensors`` (contiguous copies: safetensors refuses views and
    shared storage)."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(
        {k: v.detach().cpu().contiguous().clone() for k, v in state.items()},
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
