"""Which checkpoint a command means: a file, a sharded folder, or ``last`` (the newest run's), torch-free."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from attnlab.core.errors import CheckpointError

# a run's checkpoints under the log folder: <log_dir>/<task_name>/runs/<time>/checkpoints/
LAST_OF_ANY_RUN = "*/runs/*/checkpoints/last.ckpt"
# the file Lightning writes beside a sharded checkpoint's shards (lightning.fabric's
# _METADATA_FILENAME, restated to keep Lightning out of this module; tests/test_cli.py compares)
SHARDED_METADATA = "meta.pt"


def find_last(root: Path, pattern: str, tasks: tuple[str, ...] = ()) -> Path:
    """The newest ``last.ckpt`` under ``root`` matching ``pattern`` (of a run of one of ``tasks``)."""
    found = sorted(Path(root).glob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise CheckpointError(f"ckpt_path=last: no checkpoint matches {Path(root) / pattern}")
    if not tasks:
        return found[-1]
    newest = next((p for p in reversed(found) if trained_task(p) in tasks), None)  # reads what it must
    if newest is None:
        raise CheckpointError(f"ckpt_path=last: no run of a {' or '.join(tasks)} under {root}")
    return newest


def trained_task(ckpt: Path) -> str | None:
    """The task class a checkpoint's run trained, from its run's ``config.yaml``; None if unreadable."""
    from omegaconf import OmegaConf

    config = ckpt.parent.parent / "config.yaml"
    try:
        return model_names(OmegaConf.load(config).get("model"))[0]
    except Exception:  # any unreadable config: that run is not a candidate
        return None


def resolve_ckpt_path(spec: str | None, root: Path, pattern: str, tasks: tuple[str, ...] = ()) -> Path | None:
    """``None``, an existing file, or ``last``: the newest ``last.ckpt`` under ``root`` (of a run
    of one of ``tasks``, when given: an inference CLI takes the newest run it can serve)."""
    if spec is None:
        return None
    if str(spec) == "last":
        path = find_last(root, pattern, tasks)
        # on stderr, not the log: the inference CLIs keep the console free of log lines
        print(
            f"ckpt_path=last -> {path}" + (f" (the newest {' or '.join(tasks)} run)" if tasks else ""),
            file=sys.stderr,
        )
        return path
    path = Path(spec).expanduser()
    if not (path.is_file() or is_sharded(path)):
        raise CheckpointError(f"ckpt_path={spec}: no such file")
    return path


def is_sharded(path: Path) -> bool:
    """A sharded checkpoint (FSDP, FSDP2): a folder of per-rank files plus Lightning's ``meta.pt``."""
    return path.is_dir() and (path / SHARDED_METADATA).is_file()


def model_names(model: Any) -> tuple[str, str]:
    """The class names of a ``model`` config node's task and net (its ``_target_``s, not imported)."""
    model = model or {}
    task = model.get("_target_")
    net = (model.get("net") or {}).get("_target_")
    return str(task).rsplit(".", 1)[-1], str(net).rsplit(".", 1)[-1]
