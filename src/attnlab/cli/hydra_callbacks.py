"""Hydra callbacks of the entry points that keep a run folder (``conf/hydra/default.yaml``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


class WritableRunFolder(Callback):
    """Before Hydra makes the run (or multirun) folder, check that it can: an unwritable or
    impossible ``paths.log_dir`` is one line and exit status 2, not a traceback from ``mkdir``."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_writable(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_writable(config, "hydra.sweep.dir")


def check_writable(config: DictConfig, key: str) -> None:
    folder = Path(str(OmegaConf.select(config, key)))  # ${now:...} is cached: Hydra gets the same
    probe = folder / ".attnlab-write-test"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as e:
        print(
            f"error: cannot write the run folder {folder} ({e.strerror or e}); set paths.log_dir "
            "(or paths.root_dir) to a writable directory",
            file=sys.stderr,
        )
        sys.exit(2)
