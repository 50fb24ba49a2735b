"""Lightning's CSV logger, made to continue a log that another process, or the run a resumed run
continues, started."""

from __future__ import annotations

import csv
from pathlib import Path

from lightning.pytorch import loggers as pl_loggers
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer, taking the columns of the file it appends to (under ``ddp_spawn``, testing
    after fit would rewrite the header with the test's alone)."""

    _file_columns_read = False

    def _check_log_dir_exists(self) -> None:
        """Lightning's deletes a ``metrics.csv`` it finds; every run folder here is new, so one found
        is this run's own: the history a resumed run carried over (``continue_history``)."""

    def _record_new_keys(self) -> set[str]:
        # once per writer: after its first save, this writer is the one that writes the file
        if not self._file_columns_read and self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                header = next(csv.reader(f), [])
            self.metrics_keys.extend(k for k in header if k not in self.metrics_keys)
        self._file_columns_read = True
        return super()._record_new_keys()


def continue_history(ckpt_path: Path, global_step: int, log_dir: Path) -> int:
    """Start a resumed run's CSV with its checkpoint run's rows before ``global_step``; the number copied."""
    source = ckpt_path.parent.parent / "csv" / "metrics.csv"  # <run>/checkpoints/last.ckpt
    target = log_dir / "metrics.csv"
    if not source.is_file() or target.exists():
        return 0
    with source.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = [r for r in reader if r.get("step") and int(float(r["step"])) < global_step]
        columns = reader.fieldnames or []
    if not rows:
        return 0
    log_dir.mkdir(parents=True, exist_ok=True)
    with target.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


class CSVLogger(pl_loggers.CSVLogger):
    """Lightning's ``CSVLogger`` with the ``ContinuingWriter``."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuingWriter(log_dir=self.log_dir)
        return self._experiment
