"""A CSV logger whose ``metrics.csv`` survives a resume (Lightning's own deletes it)."""

from __future__ import annotations

import csv
import os

from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        # keep an existing metrics.csv and continue its header, instead of deleting it
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` that appends to the run's ``metrics.csv``, so curves of a resumed run keep their history."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
