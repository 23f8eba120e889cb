"""SIGTERM, SIGUSR1 and Ctrl-C outside the training loop of ``train.py``.

While training runs, :class:`~deqscore.lightning.callbacks.SaveOnInterrupt` takes these signals over: the batch
under way finishes, its state is saved, and the run ends with :class:`~deqscore.lightning.callbacks.Preempted`
(status 143, Ctrl-C 130). Outside that window Lightning would leave them to their default action (SIGTERM kills the
process, status -15, which a batch script reads as 143) or to its own handlers. :class:`StopSignals` holds them for
the whole life of the command instead, so that the exit status says what a batch script must do:

* before training starts (parsing, data preparation, setup, the sanity check) there is nothing to save: the run
  stops at once with ``Preempted(saved=False)``, status 143 (130), and a launch of it again starts where it would
  have (a fresh run's directory, which holds no checkpoint, is moved aside: ``train.py``);
* after training finished (the final sample grid and curves, the loggers' last writes, the process's exit), or after
  a stop whose state is already saved, the signal is noted and the command ends as it would have: status 0 for a
  finished run, which a requeue must not start again.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from ..lightning.callbacks import Preempted, SaveOnInterrupt

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """The handler of :data:`STOP_SIGNALS` for the life of one ``train.py`` command (a context manager); the
    training loop's own (``saver``, set by the CLI when a fit starts) takes over while it runs."""

    def __init__(self) -> None:
        self.saver: SaveOnInterrupt | None = None
        self.after_training: int | None = None  # the first signal that came after training finished
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: object) -> None:
        saver = self.saver
        if saver is not None and saver.finished:
            self.after_training = self.after_training or signum
            return
        if saver is not None and saver.saved:  # the state of this stop is written: the run is ending already
            return
        raise Preempted(signum, saved=False)
