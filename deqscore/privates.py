"""Every private part of Lightning and of ``torch.utils.data`` that deqscore relies on, in one place, each under a
name that says what it does for the library. None of these has a public equivalent in Lightning 2.6; the release
series is pinned for them (``pytorch-lightning>=2.6,<2.7`` in pyproject.toml, the exact release in
constraints.txt), and ``tests/test_lightning_privates.py`` checks each one against the installed release, so that a
release that changes one fails there, naming it, rather than changing a run silently.

* a checkpoint's loop state (Lightning's layout of ``checkpoint["loops"]``): read for the logging step of a
  resume, rewritten so that a resumed run continues exactly (:func:`complete_finished_epoch`,
  :func:`reopen_cut_epoch`), and the checkpoint callbacks' saved paths carried to a moved run directory;
* the running fit loop: the count of optimizer-stepping batches (the step axis of the per-step metrics), the step a
  resume from a checkpoint saved now logs at, whether the batch is the epoch's last, and a restart turned into a
  fresh epoch;
* :class:`~pytorch_lightning.callbacks.ModelCheckpoint`'s own save of ``last.ckpt``;
* the trainer a LightningModule is attached to, or None;
* ``CSVLogger``'s writer, made to continue an existing ``metrics.csv`` (:class:`AppendingCSVLogger`);
* :class:`~pytorch_lightning.strategies.DDPStrategy`'s process-group timeout and DDP options, and the launcher's
  watch over a node's ranks (:func:`give_ranks_time_to_report`);
* the hyper-parameters LightningCLI records (``_class_path``, ``_instantiator``) and the context that records them;
* LightningCLI's private steps of a run, overridable here under public names (:class:`LightningCLIHooks`);
* ``DataLoader._index_sampler``, where a loader draws a pass's indices (:class:`IndexSamplerLoader`).
"""

from __future__ import annotations

import csv
import os
import time
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.core.mixins.hparams_mixin import _given_hyperparameters_context
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.strategies.launchers import subprocess_script
from torch.utils.data import DataLoader

# ----- a checkpoint's loop state ------------------------------------------------------------------------------------


def _fit_loop(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return (checkpoint.get("loops") or {}).get("fit_loop") or {}


def checkpoint_batches_that_stepped(checkpoint: dict[str, Any]) -> int:
    """The fit loop's count of optimizer-stepping batches saved in ``checkpoint`` (its ``global_step`` for a
    checkpoint without loop state)."""
    loop = _fit_loop(checkpoint).get("epoch_loop.state_dict", {})
    return int(loop.get("_batches_that_stepped", checkpoint.get("global_step", 0)))


def saved_at_batch_end(checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` was saved in a training batch's end hooks (a mid-epoch or preemption checkpoint):
    its batch counters show the batch processed but not yet completed."""
    total = _fit_loop(checkpoint).get("epoch_loop.batch_progress", {}).get("total", {})
    return bool(total) and total["started"] == total["ready"] == total["processed"] == total["completed"] + 1


def complete_finished_epoch(checkpoint: dict[str, Any]) -> bool:
    """Mark an epoch whose batches all ran (saved from its end hooks) as completed in ``checkpoint``'s loop state;
    True if it was one. With ``max_steps`` set, Lightning 2.6 would replay the epoch's end on resume (hooks run twice,
    the epoch counted twice, every later epoch's data order shifted)."""
    fit_loop = _fit_loop(checkpoint)
    if not fit_loop or not fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch"):
        return False
    progress = fit_loop["epoch_progress"]
    trackers = (progress["total"], progress["current"])
    if not all(t["ready"] == t["started"] == t["processed"] == t["completed"] + 1 for t in trackers):
        return False
    for tracker in trackers:
        tracker["completed"] = tracker["processed"]
    return True


def reopen_cut_epoch(checkpoint: dict[str, Any]) -> bool:
    """Mark an epoch cut before its last batch (by ``max_steps`` or another stop) as unfinished in ``checkpoint``'s
    loop state; True if it was one. Lightning counts it completed and resumes at the next epoch (the rest never
    trained, later data orders shifted); unfinished, a resume continues it from the next batch
    (:class:`~deqscore.data.datasets.ResumableLoader`), as from a preemption checkpoint."""
    fit_loop = _fit_loop(checkpoint)
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    if not batches or batches.get("is_last_batch") or not batches["current"]["completed"]:
        return False
    progress = fit_loop["epoch_progress"]
    trackers = (progress["total"], progress["current"])
    if not all(t["ready"] == t["started"] == t["processed"] == t["completed"] > 0 for t in trackers):
        return False
    for tracker in trackers:
        tracker["processed"] -= 1
        tracker["completed"] -= 1
    return True


def relocate_checkpoint_states(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Carry the paths a resumed run's checkpoint callbacks recorded over to the run directory's new place (moved or
    copied). Lightning would otherwise drop their state: ``last.ckpt`` written again as ``last-v1.ckpt``, the best
    scores forgotten, and the closing stage reading the best weights from the old place."""
    if not trainer.ckpt_path:
        return
    here = Path(trainer.ckpt_path).resolve().parent
    states = checkpoint.get("callbacks") or {}
    for callback in trainer.checkpoint_callbacks:
        state, new = states.get(getattr(callback, "state_key", None)), getattr(callback, "dirpath", None)
        old = state.get("dirpath") if isinstance(state, dict) else None
        if not old or not new or old == new or Path(new).resolve() != here:
            continue

        def moved(path: Any, old: str = old, new: str = new) -> Any:
            return str(Path(new) / Path(path).name) if isinstance(path, str) and path and Path(path).parent == Path(
                old) else path

        state["dirpath"] = new
        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            if key in state:
                state[key] = moved(state[key])
        if isinstance(state.get("best_k_models"), dict):
            state["best_k_models"] = {moved(path): score for path, score in state["best_k_models"].items()}


# ----- the running fit loop -------------------------------------------------------------------------------------------


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step Lightning logs per-step metrics at: its count of optimizer-stepping batches, which differs from
    ``global_step`` when a family steps several optimisers in a batch."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def next_log_step(trainer: pl.Trainer) -> int:
    """The step a run resumed from a checkpoint saved now logs its first batch at: the count of optimizer-stepping
    batches, plus the batch under way where Lightning has not counted it yet. It counts a batch after the batch's end
    hooks and after a validation run at the batch's end, so a save from either (a preemption, a mid-epoch
    ``last.ckpt``) precedes the count, which a resume then completes; a save at the epoch's end follows it."""
    loop = trainer.fit_loop.epoch_loop
    progress = loop.batch_progress.total
    in_batch_end = progress.completed < progress.processed
    in_validation_of_fit = trainer.validating and trainer.state.fn == "fit" and not trainer.sanity_checking
    return loop._batches_that_stepped + int((in_batch_end or in_validation_of_fit) and not loop._should_accumulate())


def at_last_batch_of_epoch(trainer: pl.Trainer) -> bool:
    """Whether the training batch being run is its epoch's last."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def start_epoch_afresh(trainer: pl.Trainer) -> None:
    """The epoch being started is a fresh one, not the restart of an unfinished one (after
    :func:`complete_finished_epoch`)."""
    trainer.fit_loop.epoch_loop.restarting = False


def save_last_checkpoint(callback: ModelCheckpoint, trainer: pl.Trainer) -> None:
    """``callback`` writes its ``last.ckpt`` of the trainer's present state now, unless it skips saving here
    (a sanity check, a fast dev run, a trainer that is stopping without a state to save)."""
    if not callback._should_skip_saving_checkpoint(trainer):
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The trainer ``module`` is attached to, or None (``module.trainer`` raises for a module used on its own)."""
    return module._trainer


# ----- the CSV log of a resumed run ---------------------------------------------------------------------------------


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        # keep an existing metrics.csv and continue its header, instead of deleting it
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])


class AppendingCSVLogger(CSVLogger):
    """``CSVLogger`` that appends to an existing ``metrics.csv`` and continues its columns (Lightning's own
    deletes the file when it starts writing)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


# ----- DDP -------------------------------------------------------------------------------------------------------


def set_process_group_timeout(strategy: DDPStrategy, seconds: float) -> None:
    """The timeout of the process group ``strategy`` makes at the start of fit or test (read when it is made)."""
    strategy._timeout = timedelta(seconds=seconds)


class PatientObserver(_ChildProcessObserver):
    """Lightning's watch over the ranks a node's first process launched, which kills every process of the node
    (SIGKILL) once it sees one of them exit with an error, made to wait ``grace_s`` first: the first process's own
    collective fails a moment after the rank dies, and it says which rank was lost (:mod:`deqscore.cli.ranks`) and
    exits. Killed at once, it died before saying so whenever it was slower than the watch's 5-second poll."""

    grace_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed_at: float | None = None

    def _run(self) -> bool:
        for proc in self._child_processes:
            proc.poll()
        if self.failed_at is None and any(proc.returncode for proc in self._child_processes):
            self.failed_at = time.monotonic()
        if self.failed_at is not None and time.monotonic() - self.failed_at < self.grace_s:
            return False
        return super()._run()


def _launch_patient_observer(child_processes: list) -> None:
    PatientObserver(child_processes=child_processes, main_pid=os.getpid()).start()


def give_ranks_time_to_report() -> None:
    """Make the DDP launcher watch its ranks with :class:`PatientObserver` (read when it launches them)."""
    subprocess_script._launch_process_observer = _launch_patient_observer


def finds_unused_parameters(strategy: DDPStrategy) -> bool:
    """Whether ``strategy`` wraps the module in a DDP told to expect parameters a backward does not reach."""
    return bool(strategy._ddp_kwargs.get("find_unused_parameters"))


# ----- the hyper-parameters LightningCLI records --------------------------------------------------------------------

#: where LightningCLI's instantiation records a module's class among its hyper-parameters
CLASS_PATH_KEY = "_class_path"
#: where it records the instantiator that rebuilds the module from them
INSTANTIATOR_KEY = "_instantiator"


def recording_hyperparameters(hparams: dict[str, Any], instantiator: str) -> AbstractContextManager:
    """A context in which a module built saves ``hparams`` (and ``instantiator``) as its hyper-parameters, as
    LightningCLI's instantiation does."""
    return _given_hyperparameters_context(hparams=hparams, instantiator=instantiator)


# ----- LightningCLI's steps of a run --------------------------------------------------------------------------------


class LightningCLIHooks(LightningCLI):
    """LightningCLI with its private steps of a run overridable under public names: each name runs Lightning's own
    step, which a subclass extends through ``super()``."""

    def read_ckpt_path(self) -> None:
        """After parsing: Lightning puts the hyper-parameters of ``--ckpt_path``'s checkpoint into the config."""
        LightningCLI._parse_ckpt_path(self)

    def add_configure_optimizers(self, subcommand: str | None) -> None:
        """After instantiation: Lightning gives the model the ``configure_optimizers`` of ``--optimizer`` and
        ``--lr_scheduler``."""
        LightningCLI._add_configure_optimizers_method_to_model(self, subcommand)

    def run_subcommand(self, subcommand: str) -> None:
        """Lightning calls the trainer's method ``subcommand`` with the model, the data module and its options."""
        LightningCLI._run_subcommand(self, subcommand)

    def _parse_ckpt_path(self) -> None:
        self.read_ckpt_path()

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        self.add_configure_optimizers(subcommand)

    def _run_subcommand(self, subcommand: str) -> None:
        self.run_subcommand(subcommand)


# ----- where a DataLoader draws its indices -------------------------------------------------------------------------


def loader_index_sampler(loader: DataLoader) -> Any:
    """What ``loader`` draws a pass's indices from, as torch sets it up: its batch sampler, or its sampler when it
    does not batch."""
    return DataLoader._index_sampler.fget(loader)


class IndexSamplerLoader(DataLoader):
    """A DataLoader whose passes draw their indices from :meth:`index_sampler` (torch's own by default: see
    :func:`loader_index_sampler`); its length is that sampler's."""

    def index_sampler(self) -> Any:
        return loader_index_sampler(self)

    @property
    def _index_sampler(self) -> Any:
        return self.index_sampler()
