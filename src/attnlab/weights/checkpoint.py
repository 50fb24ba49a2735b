"""Finding, reading and checking checkpoints, with one clear error for each way they go wrong."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from attnlab.core.errors import CheckpointError, first_line
from attnlab.core.run_paths import is_sharded, model_names

log = logging.getLogger(__name__)

# what torch.load and the sharded reader raise on a file that is no checkpoint (not our bugs)
UNREADABLE = (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError)
UNREADABLE += (AttributeError, KeyError, TypeError, AssertionError)


# The records torch.distributed.checkpoint pickles into a sharded checkpoint's ``.metadata``.
_METADATA_RECORDS = "Metadata MetadataIndex StorageMeta TensorStorageMetadata BytesStorageMetadata"
_METADATA_RECORDS += " ChunkStorageMetadata TensorProperties _MEM_FORMAT_ENCODING"
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in _METADATA_RECORDS.split()),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds only those records and torch dtypes: any other global a pickle names is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    """torch's reader with ``.metadata`` read by a restricted unpickler (torch's own uses plain
    ``pickle.load``, so a planted ``.metadata`` runs code) and every shard inside the folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not dcp Metadata")
        for info in (metadata.storage_data or {}).values():
            shard = Path(info.relative_path)
            if shard.is_absolute() or ".." in shard.parts:
                raise pickle.UnpicklingError(f".metadata points outside the folder ({shard})")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict like torch's planner, but unpickles the non-tensor entries
    (step counters, hyperparameters) with ``weights_only=True`` where torch's uses ``False``."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        obj = torch.load(value, map_location="cpu", weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_sharded_checkpoint(folder: Path) -> dict[str, Any]:
    """A sharded checkpoint assembled into full tensors here, no process group, only plain data unpickled."""
    reader = SafeFileSystemReader(folder)
    reader.read_metadata()  # a planted or broken .metadata fails here with its own message
    ckpt: dict[str, Any] = {}
    try:
        _load_state_dict(ckpt, storage_reader=reader, planner=_WeightsOnlyPlanner(), no_dist=True)
    except CheckpointException as e:  # wraps each rank's traceback: keep the cause's last line
        raise RuntimeError(str(e).strip().splitlines()[-1]) from e
    ckpt.update(torch.load(folder / _METADATA_FILENAME, map_location="cpu", weights_only=True))
    return ckpt


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a Lightning checkpoint as plain tensors and containers (``weights_only=True``); a
    sharded one is assembled into full tensors in this process. Nothing in either can run code."""
    if path.is_file() and path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): not a PyTorch checkpoint")
    try:
        ckpt = (
            load_sharded_checkpoint(path)
            if is_sharded(path)
            else torch.load(path, map_location="cpu", weights_only=True)
        )
    except UNREADABLE as e:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a PyTorch checkpoint ({first_line(e)})"
        ) from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"checkpoint {path} has no 'state_dict': not a Lightning checkpoint")
    return ckpt


def metadata(ckpt: dict[str, Any], path: Path) -> dict[str, Any]:
    """What attnlab stored beside the weights: resolved config, data artifacts, W&B run id."""
    meta = ckpt.get("attnlab")
    if not isinstance(meta, dict) or "config" not in meta:
        raise CheckpointError(f"checkpoint {path} was not written by attnlab (no run metadata)")
    if "artifacts" not in meta:  # written before artifacts: only text runs, with a tokenizer
        meta["artifacts"] = {"tokenizer": meta["tokenizer"]} if meta.get("tokenizer") else {}
    return meta


def recorded_model(meta: dict[str, Any]) -> tuple[str, str]:
    """The task and net a checkpoint's run configured, from its saved config."""
    from omegaconf import OmegaConf

    return model_names(OmegaConf.create(meta["config"]).get("model"))


def require_same_model(meta: dict[str, Any], path: Path, model: Any) -> None:
    """Refuse to resume a run of another task or architecture than the ``model`` configured."""
    (task, net), (ours, our_net) = recorded_model(meta), model_names(model)
    if (task, net) != (ours, our_net):
        raise CheckpointError(
            f"ckpt_path={path} holds a {task} ({net}) but this run configures a {ours} ({our_net}); "
            "resume with the experiment that wrote it"
        )


def require_task(meta: dict[str, Any], path: Path | str, tasks: tuple[str, ...], need: str) -> None:
    """Refuse a checkpoint whose run trained another task than ``tasks`` (class names), by its record."""
    task, net = recorded_model(meta)
    if task not in tasks:
        raise CheckpointError(f"checkpoint {path} holds a {task} ({net}); {need} ({' or '.join(tasks)})")


def check_fits(model: nn.Module, state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Raise naming the first differences if ``state_dict`` does not fit ``model``."""
    expected = model.state_dict()
    problems = [f"missing {k}" for k in expected if k not in state_dict]
    problems += [f"unexpected {k}" for k in state_dict if k not in expected]
    problems += [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in state_dict.items()
        if k in expected and v.shape != expected[k].shape
    ]
    if problems:
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint {path} does not match the configured model: " + "; ".join(problems[:5]) + more
        )


def fit_heads(
    state: dict[str, torch.Tensor], own: dict[str, torch.Tensor], heads: tuple[str, ...]
) -> tuple[list[str], list[str], list[str]]:
    """Heads (names starting with ``heads``) of another size, or on one side only, made the net's own in
    ``state``, to start fresh: the names (resized, missing from ``state``, dropped as the net has none)."""
    resized = [k for k, v in state.items() if k.startswith(heads) and k in own and v.shape != own[k].shape]
    missing = [k for k in own if k.startswith(heads) and k not in state]
    extra = [k for k in state if k.startswith(heads) and k not in own]
    for k in extra:
        del state[k]
    state |= {k: own[k] for k in resized + missing}
    return resized, missing, extra


class AtomicCheckpointIO(TorchCheckpointIO):
    """Each checkpoint written to a temporary file, then renamed into place; a failed write is one line."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            super().save_checkpoint(checkpoint, tmp, storage_options)
            os.replace(tmp, path)
        except OSError as e:
            kept = "; the checkpoints written before are kept" if any(path.parent.glob("*.ckpt")) else ""
            raise CheckpointError(f"cannot write checkpoint {path}: {e.strerror or e}{kept}") from e
        finally:
            with contextlib.suppress(OSError):  # gone, or its folder never made
                tmp.unlink()
