"""Reading and writing another library's saved model folder (as transformers, timm and open_clip
save them, and the Hugging Face hub holds them): its weights (safetensors, or a PyTorch file read
with ``weights_only``: nothing in either can run code; ``read_weights`` is every converter's
reader), its ``config.json``, and the checks every converter makes (the architecture it describes,
each tensor fitting ours).

A converter maps the file's names onto ours as ``{our name: (their name, tensor)}``, so that the
first tensor that does not fit is named as the file names it.
"""

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
    """Every tensor of a saved model (``source``: a weights file, or a folder holding one of
    ``names``), on the CPU, for every converter (transformers, timm, open_clip): safetensors
    (sharded ones through their index), or a PyTorch file loaded with ``weights_only`` (nothing in
    it can run code; a file that needs more is refused). As timm's ``load_state_dict`` does,
    ``{"state_dict": ...}``/``{"model": ...}`` is unwrapped and DDP's ``module.`` prefix dropped."""
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
