"""Finding, reading and checking checkpoints, with one clear error for each way they go wrong."""

from __future__ import annotations

import logging
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from attnlab.errors import CheckpointError

log = logging.getLogger(__name__)


def find_last(root: Path, pattern: str) -> Path:
    """The most recently written ``last.ckpt`` under ``root`` matching ``pattern``."""
    found = sorted(Path(root).glob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise CheckpointError(f"ckpt_path=last: no checkpoint matches {Path(root) / pattern}")
    return found[-1]


def resolve_ckpt_path(spec: str | None, root: Path, pattern: str) -> Path | None:
    """``None``, an existing file, or ``last`` (the newest ``last.ckpt`` under ``root``)."""
    if spec is None:
        return None
    if str(spec) == "last":
        path = find_last(root, pattern)
        log.info("ckpt_path=last -> %s", path)
        return path
    path = Path(spec).expanduser()
    if not (path.is_file() or is_sharded(path)):
        raise CheckpointError(f"ckpt_path={spec}: no such file")
    return path


def is_sharded(path: Path) -> bool:
    """A sharded checkpoint (FSDP, FSDP2): a folder of per-rank files plus Lightning's ``meta.pt``."""
    return path.is_dir() and (path / _METADATA_FILENAME).is_file()


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a Lightning checkpoint as plain tensors and containers (``weights_only=True``); a
    sharded one is assembled into full tensors in this process."""
    try:
        if is_sharded(path):
            ckpt = _load_distributed_checkpoint(path)
        else:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a PyTorch checkpoint "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
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


def resolve_pretrained(spec: str, log_dir: Path) -> Path:
    """``model.pretrained_ckpt``: a checkpoint file, or the name of a task whose newest run's
    ``last.ckpt`` is used (e.g. ``bert_pretrain_sst2``)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if "/" not in spec and not spec.endswith(".ckpt"):
        try:
            return find_last(log_dir, f"{spec}/runs/*/checkpoints/last.ckpt")
        except CheckpointError:
            raise CheckpointError(f"model.pretrained_ckpt={spec}: no run of that task under {log_dir} "
                                  "(pre-train first) and no such file") from None
    raise CheckpointError(f"model.pretrained_ckpt={spec}: no such file")


def pretrained_artifacts(path: Path) -> dict[str, Any]:
    """The data artifacts a fine-tuning run takes over from its pre-training checkpoint: the
    tokenizer, not the classes."""
    artifacts = metadata(load_checkpoint(path), path)["artifacts"]
    if "tokenizer" not in artifacts:
        raise CheckpointError(f"model.pretrained_ckpt={path} holds no tokenizer: not a text pre-training run")
    return {"tokenizer": artifacts["tokenizer"]}


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
            f"checkpoint {path} does not match the configured model: "
            + "; ".join(problems[:5]) + more
        )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file, then rename it into place.

    A run killed mid-write (``kill -9``, out of memory) leaves the previous ``last.ckpt``
    intact instead of a truncated one, so ``ckpt_path=last`` can always resume.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
