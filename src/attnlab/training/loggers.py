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


def continue_history(source: Path, global_step: int, target: Path) -> int:
    """Write to the CSV log ``target`` (a new one, or ``source`` itself: a requeued job logs those steps
    again) the rows of ``source`` before ``global_step``, less a last line cut mid-write; the number kept."""
    if not source.is_file() or (target.exists() and not target.samefile(source)):
        return 0
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    reader = csv.DictReader(lines)
    kept = [r for r in reader if not r.get("step") or int(float(r["step"])) < global_step]
    if not kept and not target.exists():
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.part")
    with part.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=reader.fieldnames or [])
        writer.writeheader()
        writer.writerows(kept)
    part.replace(target)
    return len(kept)


class CSVLogger(pl_loggers.CSVLogger):
    """Lightning's ``CSVLogger`` with the ``ContinuingWriter``."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuingWriter(log_dir=self.log_dir)
        return self._experiment
