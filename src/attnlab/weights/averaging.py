"""Checkpoint averaging (timm's ``avg_checkpoints.py``, fairseq's ``average_checkpoints.py``): the
mean of a run's last N checkpoints' weights, often better than the last alone at the end of a
run whose learning rate has not decayed to zero."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.core.errors import CheckpointError
from attnlab.weights.checkpoint import AtomicCheckpointIO, load_checkpoint

AVERAGED = "average_last{n}.ckpt"  # beside the run's checkpoints, never itself an input
KEEP_ALL = "callbacks.model_checkpoint.save_top_k=-1"  # the override that keeps every checkpoint


def run_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """The checkpoints in a run's ``checkpoints/`` folder, one per training step, averages left out."""
    by_step: dict[int, Path] = {}
    for path in sorted(folder.glob("*.ckpt"), key=lambda p: p.name == "last.ckpt"):
        if path.name.startswith("average_last"):
            continue
        by_step.setdefault(step(path), path)
    return sorted(by_step.items())


def step(path: Path) -> int:
    """A checkpoint's training step, its tensors mapped rather than read where it is one file."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # a sharded folder, or a broken file: load_checkpoint reads it or says why
        ckpt = load_checkpoint(path)
    return int(ckpt.get("global_step") or 0)


def last_checkpoints(folder: Path, n: int) -> list[tuple[int, Path]]:
    """The ``n`` checkpoints of the latest steps, oldest first; fewer there is one line."""
    found = run_checkpoints(folder) if folder.is_dir() else []
    if len(found) < n:
        raise CheckpointError(
            f"{folder}: {len(found)} checkpoint(s), --last {n} needs {n} (train with {KEEP_ALL} "
            "to keep one at every validation)"
        )
    return found[-n:]


def average_state_dicts(states: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The mean of each floating-point tensor (summed in float64, as timm does); integer and boolean
    tensors (step counters, masks) copied from the last."""
    last = states[-1]
    for i, state in enumerate(states[:-1]):
        if state.keys() != last.keys():
            different = sorted(state.keys() ^ last.keys())[0]
            raise CheckpointError(f"checkpoint {i + 1} of {len(states)} and the last differ in {different}")
    averaged = {}
    for key, value in last.items():
        if value.is_floating_point():
            total = sum(state[key].double() for state in states)
            averaged[key] = (total / len(states)).to(value.dtype)
        else:
            averaged[key] = value.clone()
    return averaged


def average_last(run_dir: Path, n: int) -> tuple[Path, Path, list[int]]:
    """The average of the run's last ``n`` checkpoints written as ``checkpoints/average_last<n>.ckpt``
    (the last's record, no optimizer state): its path, the last checkpoint's and the steps averaged."""
    folder = run_dir / "checkpoints"
    chosen = last_checkpoints(folder, n)
    ckpts = [load_checkpoint(path) for _, path in chosen]
    record: dict[str, Any] = {
        k: v for k, v in ckpts[-1].items() if k not in ("optimizer_states", "lr_schedulers")
    }
    record["state_dict"] = average_state_dicts([c["state_dict"] for c in ckpts])
    record["averaged_from"] = [{"path": path.name, "step": step} for step, path in chosen]
    out = folder / AVERAGED.format(n=n)
    AtomicCheckpointIO().save_checkpoint(record, out)
    return out, chosen[-1][1], [step for step, _ in chosen]
