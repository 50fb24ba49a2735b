"""Lightning's CSV logger, made to continue a log that another process started."""

from __future__ import annotations

import csv

from lightning.pytorch import loggers as pl_loggers
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer, taking the columns of the file it appends to.

    Under ``trainer=ddp_spawn`` testing after fit runs in new processes, whose writer knew only the
    test's columns; rewriting the file's header with those alone failed ("dict contains fields not
    in fieldnames").
    """

    _file_columns_read = False

    def _record_new_keys(self) -> set[str]:
        # once per writer: after its first save, this writer is the one that writes the file
        if not self._file_columns_read and self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                header = next(csv.reader(f), [])
            self.metrics_keys.extend(k for k in header if k not in self.metrics_keys)
        self._file_columns_read = True
        return super()._record_new_keys()


class CSVLogger(pl_loggers.CSVLogger):
    """Lightning's ``CSVLogger`` with the ``ContinuingWriter``."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuingWriter(log_dir=self.log_dir)
        return self._experiment
