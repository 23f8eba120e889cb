"""Loggers add up: the run's CSV log is always written, a logger given on the command line joins it, and
TensorBoard (when installed) logs the same scalars and the sample grids as images."""

import importlib.util

import pytest

from deqscore.cli.train import main
from deqscore.lightning.callbacks import read_metrics_csv

from .conftest import tiny_args

needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="tensorboard is not installed")


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


@needs_tensorboard
def test_a_given_logger_joins_the_csv_log_and_tensorboard_sees_the_same(tmp_path):
    extra = tmp_path / "extra"
    main(["fit", *tiny_args(tmp_path, "configs/demo.yaml", "logs"), "--trainer.max_steps", "2",
          "--trainer.limit_val_batches", "1", "--trainer.logger", "pytorch_lightning.loggers.CSVLogger",
          "--trainer.logger.save_dir", str(extra)])
    run = tmp_path / "logs"
    ours = read_metrics_csv(run / "metrics.csv")
    assert [s for s, _ in ours["train/loss"]] == [0, 1]  # the run's own CSV log, as without the extra logger
    theirs = read_metrics_csv(next(extra.rglob("metrics.csv")))
    assert theirs["train/loss"] == ours["train/loss"]  # the given logger, beside it
    events = _scalars(run)
    assert [round(e.value, 4) for e in events.Scalars("train/loss")] == [round(v, 4) for _, v in ours["train/loss"]]
    assert any(tag.startswith("samples/") for tag in events.Tags()["images"])  # the sample grid of fit's end


def test_logger_false_writes_no_log(tmp_path):
    main(["fit", *tiny_args(tmp_path, "configs/demo.yaml", "quiet"), "--trainer.max_steps", "1",
          "--trainer.limit_val_batches", "0", "--trainer.logger", "false"])
    assert not (tmp_path / "quiet" / "metrics.csv").exists()
