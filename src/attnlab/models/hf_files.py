"""Reading and writing another library's saved model folder: its weights (safetensors, or a
``pytorch_model.bin`` read with ``weights_only``: nothing in either can run code), its
``config.json``, and the checks every converter makes (the architecture it describes, each tensor
fitting ours).

A converter maps the file's names onto ours as ``{our name: (their name, tensor)}``, so that the
first tensor that does not fit is named as the file names it.
"""

from __future__ import annotations

import json
import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from attnlab.errors import CheckpointError

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


def weights_file(source: Path) -> Path:
    """The weights ``source`` names: the file itself, or the first of ``WEIGHT_FILES`` in it."""
    if source.is_file():
        return source
    for name in WEIGHT_FILES:
        if (source / name).is_file():
            return source / name
    raise CheckpointError(
        f"model.init_from={source}: no weights in it (expected one of {', '.join(WEIGHT_FILES)})"
    )


def read_weights(source: Path) -> dict[str, Tensor]:
    """Every tensor of a saved model, on the CPU; sharded safetensors through their index."""
    path = weights_file(source)
    try:
        if path.name.endswith(".index.json"):
            shards = sorted(set(json.loads(path.read_text(encoding="utf-8"))["weight_map"].values()))
            return {k: v for shard in shards for k, v in load_file(path.parent / shard).items()}
        if path.suffix == ".safetensors":
            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"model.init_from={path}: a pickle that holds more than tensors, which loading would run "
            "as code (refused; save the model as safetensors)"
        ) from e
    except (OSError, RuntimeError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        reason = (str(e).strip().splitlines() or ["no details"])[0][:200]
        raise CheckpointError(f"model.init_from={path}: not a readable weights file ({reason})") from e
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"model.init_from={path}: holds no state dict of tensors")
    return state


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


def load_mapped(
    module: nn.Module, mapped: Mapped, source: Path, fresh: tuple[str, ...] = (), what: str = ""
) -> None:
    """Copy ``mapped`` into ``module``. Every tensor must fit, except those under the prefixes in
    ``fresh`` (heads): missing or of another size there, they keep their new initialisation, with a
    notice. The first tensor that does not fit is one ``CheckpointError``."""
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
