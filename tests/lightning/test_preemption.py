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


@pytest.mark.parametrize(("signum", "at", "status", "said"), [  # mid-epoch; an epoch's end; mid-epoch
    (signal.SIGTERM, 5, PREEMPTED_STATUS, "preempted by SIGTERM"), (signal.SIGUSR1, 3, PREEMPTED_STATUS,
    "preempted by SIGUSR1"), (signal.SIGINT, 4, INTERRUPTED_STATUS, "interrupted by Ctrl-C")])
def test_a_preempted_run_saves_its_state_and_resumes_exactly(tmp_path, signum, at, status, said):
    reference = _start(["fit", *tiny_args(tmp_path, CONFIG, "whole"), "--trainer.max_steps", str(STEPS),
                        "--trainer.max_epochs", "-1"])
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
    for p in (resumed, reference):
        out, err = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == 0, out[-2000:] + err[-2000:]
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")  # every step, bit for bit
    assert len(_losses(tmp_path / "whole")) == STEPS
