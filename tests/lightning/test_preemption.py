"""Preemption of a real training process by a real signal: SIGTERM (a scheduler's stop), SIGUSR1 (SLURM's
warning before the time limit) and a Ctrl-C (SIGINT) save a resumable checkpoint at the end of the batch under way,
the process exits with 128 + SIGTERM (Ctrl-C: 128 + SIGINT) and one line, and the resumed run logs the same losses
as an uninterrupted one, bit for bit: in the middle of an epoch and at its last batch (the tiny data has 3 batches
an epoch)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from deqscore.lightning.callbacks import INTERRUPTED_STATUS, PREEMPTED_STATUS, read_metrics_csv

from .conftest import ROOT, tiny_args

pytestmark = pytest.mark.xdist_group("processes")  # see the Makefile's test target

CONFIG = "configs/nice/explicit.yaml"
STEPS = 12
TIMEOUT_S = 120


class StepMarker(pl.Callback):
    """Writes the finished step to ``<run>/step``, then waits: a signal sent on seeing step k arrives while batch k's
    end hooks run, so the state is saved at step k."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        Path(trainer.default_root_dir, "step").write_text(str(trainer.global_step))
        time.sleep(0.5)


def _start(args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _losses(run_dir):
    return [loss for _, loss in read_metrics_csv(run_dir / "metrics.csv")["train/loss"]]


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory):
    """The losses of the run every preempted one must repeat: one for the module (its tests share a worker)."""
    runs = tmp_path_factory.mktemp("uninterrupted")
    proc = _start(["fit", *tiny_args(runs, CONFIG, "whole"), "--trainer.max_steps", str(STEPS),
                   "--trainer.max_epochs", "-1"])
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    losses = _losses(runs / "whole")
    assert len(losses) == STEPS
    return losses


@pytest.mark.parametrize(("signum", "at", "status", "said"), [  # mid-epoch; an epoch's end; mid-epoch
    (signal.SIGTERM, 5, PREEMPTED_STATUS, "preempted by SIGTERM"), (signal.SIGUSR1, 3, PREEMPTED_STATUS,
    "preempted by SIGUSR1"), (signal.SIGINT, 4, INTERRUPTED_STATUS, "interrupted by Ctrl-C")])
def test_a_preempted_run_saves_its_state_and_resumes_exactly(tmp_path, uninterrupted_losses, signum, at, status,
                                                             said):
    marker = f"--trainer.callbacks+={__name__}.StepMarker"
    proc = _start(["fit", *tiny_args(tmp_path, CONFIG, "cut"), "--trainer.max_steps", "1000",
                   "--trainer.max_epochs", "-1", marker])
    step_file = tmp_path / "cut" / "step"
    deadline = time.monotonic() + TIMEOUT_S
    while not (step_file.exists() and step_file.read_text() and int(step_file.read_text()) >= at):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == status, out[-2000:] + err[-2000:]
    assert said in err and err.count("Traceback") == 0
    saved = tmp_path / "cut" / "checkpoints" / "interrupted.ckpt"
    assert torch.load(saved, weights_only=False)["global_step"] == at
    resumed = _start(["fit", "--config", str(tmp_path / "cut" / "config.yaml"), "--ckpt_path", str(saved),
                      "--trainer.max_steps", str(STEPS)])
    out, err = resumed.communicate(timeout=TIMEOUT_S)
    assert resumed.returncode == 0, out[-2000:] + err[-2000:]
    assert _losses(tmp_path / "cut") == uninterrupted_losses  # every step, bit for bit


def _wait_for(path, proc, at_least=0):
    deadline = time.monotonic() + TIMEOUT_S
    while not (path.exists() and path.read_text() and int(path.read_text()) >= at_least):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def _error_lines(err):
    return [line for line in err.splitlines() if line.startswith("train.py: error:")]


class SlowBatchStart(pl.Callback):
    """Writes the step about to be trained to ``<run>/step``, then waits in the batch's start: two Ctrl-C sent on
    seeing step k both arrive before batch k runs."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        Path(trainer.default_root_dir, "step").write_text(str(trainer.global_step))
        time.sleep(2)


def test_a_second_ctrl_c_stops_at_once_with_status_130_and_one_line(tmp_path):
    proc = _start(["fit", *tiny_args(tmp_path, CONFIG, "twice"), "--trainer.max_steps", "1000",
                   "--trainer.max_epochs", "-1", f"--trainer.callbacks+={__name__}.SlowBatchStart"])
    _wait_for(tmp_path / "twice" / "step", proc, at_least=2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == INTERRUPTED_STATUS, out[-2000:] + err[-2000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and "interrupted by Ctrl-C twice" in lines[0], err[-2000:]
    assert "Traceback" not in err and "Detected KeyboardInterrupt" not in err
    saved = tmp_path / "twice" / "checkpoints" / "interrupted.ckpt"  # where it landed: before batch 2 ran
    assert torch.load(saved, weights_only=False)["global_step"] == 2


class SlowFitEnd(pl.Callback):
    """Marks the end of the fit in ``<run>/fit_end`` and waits there: a signal sent on seeing it arrives after
    training finished, while the fit ends (sample grid, curves, loggers) and tears down."""

    def on_fit_end(self, trainer, module):
        Path(trainer.default_root_dir, "fit_end").write_text("1")
        time.sleep(3)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_after_the_fit_finished_leaves_status_0_so_a_batch_script_does_not_requeue(tmp_path, signum):
    """The README's SLURM script requeues on status 143 (a preempted run, its state saved). A signal in the teardown
    of a finished fit must not look like one: the requeued job would start a fresh fit, refused by the finished run."""
    proc = _start(["fit", *tiny_args(tmp_path, CONFIG, "done"), "--trainer.max_steps", "2",
                   f"--trainer.callbacks+={__name__}.SlowFitEnd"])
    _wait_for(tmp_path / "done" / "fit_end", proc)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert f"{signal.Signals(signum).name} came after training finished: the run is complete" in err
    assert not _error_lines(err) and "Traceback" not in err
    assert not (tmp_path / "done" / "checkpoints" / "interrupted.ckpt").exists()
    assert torch.load(tmp_path / "done" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2


class SlowSanityCheck(pl.Callback):
    """Marks the sanity check's first validation batch (the run directory holds its config, no checkpoint yet) in
    ``<run>/sanity`` and waits there."""

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking and batch_idx == 0:
            Path(trainer.default_root_dir, "sanity").write_text("1")
            time.sleep(3)


def test_a_signal_before_training_stops_at_once_and_a_relaunch_is_not_refused(tmp_path):
    """SIGTERM in the sanity check, where Lightning's own handler only notes it: the process ran on into training
    and then ended with status 0 (a batch script took the run for finished). It stops at once with 143 now."""
    args = ["fit", *tiny_args(tmp_path, CONFIG, "early"), "--trainer.max_steps", "2"]
    proc = _start([*args, f"--trainer.callbacks+={__name__}.SlowSanityCheck"])
    _wait_for(tmp_path / "early" / "sanity", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == PREEMPTED_STATUS, out[-2000:] + err[-2000:]  # a batch script requeues it
    lines = _error_lines(err)
    assert len(lines) == 1 and "preempted by SIGTERM before training started: nothing to save" in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "early").exists() and (tmp_path / "early.failed-1").is_dir()
    again = _start(args)  # the requeued job: the same fresh launch
    out, err = again.communicate(timeout=TIMEOUT_S)
    assert again.returncode == 0, out[-2000:] + err[-2000:]
