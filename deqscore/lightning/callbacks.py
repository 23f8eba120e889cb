"""Callbacks: sample grids during training, learning-curve plots from the run's CSV log, and the config's
optimiser options applied over those a resumed checkpoint restored."""

from __future__ import annotations

import csv
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.callbacks import WeightAveraging
from pytorch_lightning.utilities import rank_zero_info, rank_zero_only

from ..privates import at_last_batch_of_epoch
from ..sampling import pyplot, save_image_grid


def run_dir(trainer: pl.Trainer) -> Path:
    """The first logger's log_dir, else the trainer's root dir (``trainer.log_dir`` broadcasts across processes,
    which hangs when called on rank zero only)."""
    log_dir = getattr(trainer.loggers[0], "log_dir", None) if trainer.loggers else None
    return Path(log_dir or trainer.default_root_dir)


@contextmanager
def averaged_weights(trainer: pl.Trainer, module: pl.LightningModule) -> Iterator[None]:
    """For the duration, the module holds the weights validation uses: the averaged ones of every weight-averaging
    callback (EMA), swapped in and back through that callback's own validation hooks."""
    averaging = [c for c in trainer.callbacks if isinstance(c, WeightAveraging)]
    for callback in averaging:
        callback.on_validation_epoch_start(trainer, module)
    try:
        yield
    finally:
        for callback in reversed(averaging):
            callback.on_validation_epoch_end(trainer, module)


class SampleGrid(pl.Callback):
    """Write a PNG grid of ``n_samples`` model samples (:meth:`ScoreModule.sample_images`, from the averaged weights
    under EMA) every ``every_n_epochs`` epochs, ``<run>/samples/epoch_<e>.png``, and at the end of fit,
    ``<run>/samples.png``."""

    def __init__(self, n_samples: int = 64, every_n_epochs: int = 0):
        self.n_samples, self.every_n_epochs = n_samples, every_n_epochs

    @rank_zero_only
    def _write(self, trainer: pl.Trainer, module: pl.LightningModule, path: Path) -> None:
        was_training = module.training
        module.eval()
        images = module.sample_images(self.n_samples)
        save_image_grid(images, path)
        module.train(was_training)
        for logger in trainer.loggers:  # TensorBoard shows the same grids as images, on the step axis
            add_images = getattr(getattr(logger, "experiment", None), "add_images", None)
            if callable(add_images) and type(logger).__name__ == "TensorBoardLogger":
                add_images(f"samples/{path.stem}", images.float().clamp(0, 1).cpu(), trainer.global_step)

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            with averaged_weights(trainer, module):
                self._write(trainer, module, run_dir(trainer) / "samples" / f"epoch_{trainer.current_epoch:04d}.png")

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._write(trainer, module, run_dir(trainer) / "samples.png")


def read_metrics_csv(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Read a Lightning CSVLogger ``metrics.csv`` into ``{metric: [(step, value), ...]}``."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row.get("step") or 0)
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    series.setdefault(key, []).append((step, float(value)))
    return series


class LearningCurves(pl.Callback):
    """At the end of fit, plot training and validation curves from ``<run>/metrics.csv`` to ``<run>/curves.png``.

    ``metrics``: names to plot, one panel each (train and val variants share a panel).
    """

    def __init__(self, metrics: tuple[str, ...] = ("loss", "exact_sm", "log_likelihood")):
        self.metrics = metrics

    @rank_zero_only
    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for logger in trainer.loggers:
            logger.save()
        csv_path = run_dir(trainer) / "metrics.csv"
        if csv_path.exists():
            plot_learning_curves(csv_path, run_dir(trainer) / "curves.png", self.metrics)


def plot_learning_curves(csv_path: str | Path, out: str | Path, metrics: tuple[str, ...]) -> Path:
    """Plot ``train/<m>`` (per step) and ``val/<m>`` (per validation) for each metric found in the CSV."""
    plt = pyplot()
    series = read_metrics_csv(csv_path)
    names = [m for m in metrics if f"train/{m}" in series or f"val/{m}" in series]
    fig, axes = plt.subplots(1, max(len(names), 1), figsize=(4.5 * max(len(names), 1), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=False):
        for stage, style in (("train", "-"), ("val", "o-")):
            points = series.get(f"{stage}/{name}")
            if points:
                ax.plot(*zip(*points, strict=True), style, label=stage, markersize=3)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


PREEMPTED_STATUS = 128 + signal.SIGTERM  # the exit status of a run stopped by SIGTERM or SIGUSR1, its state saved
INTERRUPTED_STATUS = 128 + signal.SIGINT  # the exit status of a run stopped by Ctrl-C, its state saved


class Preempted(SystemExit):
    """A run stopped by SIGTERM, SIGUSR1 or Ctrl-C. ``saved``: its state is in ``checkpoints/interrupted.ckpt``
    (false for a signal that came before training started: there was nothing to save); ``at_once``: a second
    Ctrl-C, which stops in the middle of a step (the state is saved where it landed, :class:`SaveOnInterrupt`)."""

    def __init__(self, signum: int, saved: bool = True, at_once: bool = False):
        super().__init__(INTERRUPTED_STATUS if signum == signal.SIGINT else PREEMPTED_STATUS)
        self.signum, self.saved, self.at_once = signum, saved, at_once


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class SaveOnInterrupt(pl.Callback):
    """On Ctrl-C or preemption, save the interrupted state to ``<run>/checkpoints/interrupted.ckpt`` (resumable with
    ``--ckpt_path``; ``last.ckpt`` keeps the last regular checkpoint).

    Preemption is SIGTERM (a scheduler's stop) or SIGUSR1 (SLURM's warning before the time limit,
    ``--signal=SIGUSR1@90``); Ctrl-C (SIGINT) is taken the same way, and a second Ctrl-C stops at once (its state
    saved where the interrupt lands, which resumes off by one step). Each is taken over while training runs: the
    signal is noted, the batch under way finishes,
    its state is saved at its end (at an epoch's last batch: at the epoch's end), and the fit stops before the next
    batch (after that batch's log row). Those are where Lightning's own checkpoints are taken, so the resume
    continues exactly (the training loader is resumable within an epoch,
    :class:`~deqscore.data.datasets.ResumableLoader`). Lightning's own SIGTERM stop comes later, after the batch's
    end hooks, and its SLURM handler saves in the middle of a step; both resume off by one step. With several
    processes the ranks agree at every batch's end whether any was signalled (one small collective a step), so all
    stop at the same batch. Requeueing is the batch script's (see the README)."""

    def __init__(self) -> None:
        self._signalled: int | None = None
        self._saved = False  # the preempted state is written: stop before the next batch
        self._previous: dict[int, object] = {}
        self.finished = False  # training ran to its end: a signal now has nothing left to save

    @property
    def saved(self) -> bool:
        """The state of a stop by a signal is written (the run ends with :class:`Preempted`)."""
        return self._saved

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = {s: signal.signal(s, self._note) for s in (*PREEMPTION_SIGNALS, signal.SIGINT)}

    def _note(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self._signalled == signal.SIGINT:
            raise Preempted(signum, at_once=True)  # Ctrl-C again: now (on_exception saves the state)
        self._signalled = signum
        if signum == signal.SIGINT:
            rank_zero_info("Ctrl-C: the batch under way finishes and its state is saved (Ctrl-C again: stop now)")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if not at_last_batch_of_epoch(trainer):  # the epoch's last: saved at its end
            self._save_if_signalled(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._save_if_signalled(trainer)  # where an end-of-epoch checkpoint is taken (it resumes as one)

    def _save_if_signalled(self, trainer: pl.Trainer) -> None:
        if self._saved:
            return
        if trainer.world_size > 1:  # every rank stops at the same batch, whichever got the signal (a collective)
            if trainer.strategy.reduce_boolean_decision(self._signalled is not None, all=False):
                self._signalled = self._signalled or signal.SIGTERM
        if self._signalled is None:
            return
        self._save(trainer, f"preempted ({signal.Signals(self._signalled).name}) after")
        self._saved = True

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: object,
                             batch_idx: int) -> None:
        if self._saved:
            raise Preempted(self._signalled)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.finished = True

    def teardown(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        # Lightning restores the handlers it found before the fit first (its own teardown comes before this hook):
        # a handler of this callback's is put back only where it is still in place
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                if signal.getsignal(signum) == self._note:
                    signal.signal(signum, handler)
        self._previous = {}

    def on_exception(self, trainer: pl.Trainer, module: pl.LightningModule, exception: BaseException) -> None:
        at_once = isinstance(exception, KeyboardInterrupt) or (isinstance(exception, Preempted) and exception.at_once)
        if not at_once or trainer.state.fn != "fit":
            return  # a preemption saved its state at the batch's end
        self._save(trainer, "interrupted at")
        self._saved = True

    @staticmethod
    def _save(trainer: pl.Trainer, what: str) -> None:
        path = run_dir(trainer) / "checkpoints" / "interrupted.ckpt"
        trainer.save_checkpoint(path)
        rank_zero_info(f"{what} step {trainer.global_step}: state saved to {path} (resume: --ckpt_path {path})")


class ConfiguredOptimizerOptions(pl.Callback):
    """On a resume, the optimiser options of the config (``lr``, ``weight_decay``, ``betas``, ...) replace the
    values the checkpoint restored, so what the user asked for takes effect. A learning rate under a scheduler is
    compared with, and replaces, the group's ``initial_lr``; the scheduled value is rescaled by the same factor."""

    def __init__(self, options: dict):
        self.options = options

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        changed = []
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                changed += self._apply(group)
        for config in trainer.lr_scheduler_configs:
            groups = config.scheduler.optimizer.param_groups
            config.scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in groups]
        for text in dict.fromkeys(changed):
            rank_zero_info(f"optimizer {text} (config over checkpoint)")

    def _apply(self, group: dict) -> list[str]:
        changed = []
        for key, value in self.options.items():
            if key not in group:
                continue
            value = tuple(value) if isinstance(group[key], tuple) else value
            slot = "initial_lr" if key == "lr" and "initial_lr" in group else key
            if group[slot] == value:
                continue
            changed.append(f"{key}: {group[slot]!r} -> {value!r}")
            if slot == "initial_lr":
                group["lr"] *= value / group["initial_lr"]
            group[slot] = value
        return changed
