"""A callback that preempts its own training once, by a real SIGTERM, at step 1: while the file named by
``$DEQSCORE_TEST_PREEMPT`` exists (it is removed as the signal is sent)."""

import os
import signal
from pathlib import Path

import pytorch_lightning as pl

FLAG = "DEQSCORE_TEST_PREEMPT"


class PreemptOnce(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        flag = os.environ.get(FLAG)
        if trainer.global_step == 1 and flag and Path(flag).exists():
            Path(flag).unlink()
            os.kill(os.getpid(), signal.SIGTERM)
