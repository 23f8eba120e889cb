"""The callbacks every :class:`~deqscore.lightning.ScoreModule` brings with it (its ``configure_callbacks``), so a
family implements its model and nothing of this machinery:

* :class:`StepSeeding`: the random draws of a step (projections, noise, binarisation) depend on the step alone,
  so a resumed run repeats an uninterrupted one exactly;
* :class:`TrainingWarmStarts`: evaluation neither starts from nor moves the training's DEQ warm starts, and
  checkpoints carry them;
* :class:`ResumeFixes`: a resumed run continues as if it had not stopped (finished epochs, per-epoch data noise,
  checkpoint callbacks of a run directory that was moved or copied since);
* :class:`RunFacts`: once per run, the parameter count and the activation memory of one training step;
* :class:`ClosingStage`: a family's closing stage after fit (``ScoreModule.closing_stage``), saved as
  ``checkpoints/final.ckpt``.

:class:`SyncFreeSteps` is not one of them: a run asks for it in its trainer's callbacks.

Being the module's own callbacks, they also run for trainers built in Python, not only from the CLI.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities import rank_zero_info

from ..data.protocol import EpochData
from ..deq import DEQ, restore_warm_starts, set_aside_warm_starts
from ..errors import ConfigError
from ..losses import Loss
from ..metrics import UnmeasurableStep, parameter_count, step_activation_bytes
from ..privates import (
    batches_that_stepped,
    complete_finished_epoch,
    next_log_step,
    relocate_checkpoint_states,
    reopen_cut_epoch,
    save_last_checkpoint,
    start_epoch_afresh,
)
from .callbacks import run_dir
from .runs import LOG_STEP_KEY


def batch_inputs(batch: Any) -> torch.Tensor:
    """The model input of a batch: ``x`` or the first element of ``(x, label, ...)``."""
    return batch[0] if isinstance(batch, list | tuple) else batch


def reseed(module: pl.LightningModule, offset: int) -> None:
    """Seed the global RNG from (run seed, offset, rank)."""
    base = int(os.environ.get("PL_GLOBAL_SEED", 0))
    torch.manual_seed((base * 1_000_003 + offset * 7919 + module.global_rank) % 2**63)


class StepSeeding(pl.Callback):
    """Reseed the global RNG before every training batch (from its step), validation and test."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        # with gradient accumulation several batches share a global step; each gets its own draws
        accumulate = trainer.accumulate_grad_batches
        reseed(module, module.global_step * accumulate + batch_idx % accumulate)

    def on_validation_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        reseed(module, -1)  # the same draws at every validation, so epochs are comparable

    def on_test_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        reseed(module, -2)


WARM_STARTS_KEY = "deqscore_deq_warm_starts"  # in a checkpoint: every rank's DEQ warm starts, by layer name


def _named_deq_layers(module: pl.LightningModule) -> list[tuple[str, DEQ]]:
    return [(name, layer) for name, layer in module.named_modules() if isinstance(layer, DEQ)]


class TrainingWarmStarts(pl.Callback):
    """The training's DEQ warm starts (:meth:`~deqscore.deq.DEQ.warm_starts`), kept apart and kept. A validation or
    test starts its layers from empty warm starts and gives the training's back at its end, so the training's numbers
    do not depend on when it is evaluated. Every checkpoint carries the training's (those set aside, when it is
    written during an evaluation), every DDP rank's, and a resume takes them back: cold with another number of
    processes, or from a save that followed an exception (perhaps one process's alone: no collective is risked)."""

    def __init__(self) -> None:
        self._kept: list | None = None  # the training's, while an evaluation runs

    def on_validation_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        left = set_aside_warm_starts(module)
        if self._kept is None:  # else an evaluation that failed still holds the training's; what it left goes
            self._kept = left

    def on_validation_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        restore_warm_starts(self._kept or [])
        self._kept = None

    on_test_epoch_start = on_validation_epoch_start
    on_test_epoch_end = on_validation_epoch_end

    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        held = {id(layer): starts for layer, starts in self._kept or []}
        mine = {name: {key: start.cpu() for key, start in held.get(id(layer), layer.warm_starts()).items()}
                for name, layer in _named_deq_layers(module)}
        checkpoint[WARM_STARTS_KEY] = self._every_rank(trainer, mine)

    def on_load_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        every_rank = checkpoint.get(WARM_STARTS_KEY)
        mine = every_rank[trainer.global_rank] if isinstance(every_rank, list) and len(
            every_rank) == trainer.world_size else {}
        for name, layer in _named_deq_layers(module):
            layer.load_warm_starts(mine.get(name, {}))

    @staticmethod
    def _every_rank(trainer: pl.Trainer, mine: dict[str, dict]) -> list[dict[str, dict]] | None:
        """``mine`` of every rank in rank order, on the rank that writes the checkpoint (rank 0; None elsewhere and
        where they cannot be gathered: the checkpoint is written all the same, and resumes them cold)."""
        if trainer.world_size == 1:
            return [mine]
        if trainer.interrupted:  # a save from an exception's hooks may be this process's alone
            return None
        every: list | None = [None] * trainer.world_size if trainer.global_rank == 0 else None
        try:
            torch.distributed.gather_object(mine, every, dst=0)
        except (RuntimeError, torch.distributed.DistError):  # a peer lost: its error comes at the save's barrier
            return None
        return every


class ResumeFixes(pl.Callback):
    """A resumed run continues as an uninterrupted one: an epoch that finished before the checkpoint is not
    replayed (:func:`~deqscore.privates.complete_finished_epoch`), one cut short by the run's budget is
    continued (:func:`~deqscore.privates.reopen_cut_epoch`), data modules with epoch-dependent randomness
    (dequantisation noise, shuffling) follow the epoch through their ``set_epoch``, and a checkpoint whose optimiser
    states do not match the module's optimisers is refused (Lightning would restore the ones it has and silently
    start the others afresh).

    A run that ends mid-epoch (at ``max_steps``) writes ``last.ckpt`` at its last step (Lightning would keep the last
    epoch's end when it wrote one before). Every checkpoint records the step a resume from it logs at
    (:func:`~deqscore.privates.next_log_step`), where the resume truncates the run's log (the DEQ warm starts:
    :class:`TrainingWarmStarts`)."""

    def __init__(self) -> None:
        self._resumed_after_epoch = False
        self._saved_optimizers: int | None = None

    def on_load_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._resumed_after_epoch = complete_finished_epoch(checkpoint)
        reopen_cut_epoch(checkpoint)
        relocate_checkpoint_states(trainer, checkpoint)
        if "optimizer_states" in checkpoint:
            self._saved_optimizers = len(checkpoint["optimizer_states"])

    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        # the loop state alone cannot tell a save by a validation at a batch's end from one after the batch counted
        checkpoint[LOG_STEP_KEY] = next_log_step(trainer)

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._set_data_epoch(trainer)  # a resume in the middle of an epoch gets no on_train_epoch_start
        if self._saved_optimizers is not None and self._saved_optimizers != len(trainer.optimizers):
            raise ConfigError(
                f"--ckpt_path: the checkpoint holds {self._saved_optimizers} optimiser state(s), this "
                f"{type(module).__name__} has {len(trainer.optimizers)} optimiser(s); resume from a checkpoint of "
                "the same model and optimisers (the weights alone load with `train.py test` or sample.py)"
            )

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # before the closing stage (a later callback of the module's), which loads the best weights into the module
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last:  # its last save is of an earlier step
                save_last_checkpoint(callback, trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self._resumed_after_epoch:  # a fresh epoch after a finished one, not the restart of an unfinished one
            start_epoch_afresh(trainer)
            self._resumed_after_epoch = False
        self._set_data_epoch(trainer)

    @staticmethod
    def _set_data_epoch(trainer: pl.Trainer) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if isinstance(datamodule, EpochData):
            datamodule.set_epoch(trainer.current_epoch)


class RunFacts(pl.Callback):
    """Once per run, at its first training batch: ``run/parameters`` and ``run/activation_memory_mb`` (the tensors
    autograd saves in the forward and backward of one batch's objective, parameters excluded: the benchmark's
    meter, :func:`deqscore.metrics.step_activation_bytes`), logged on the step axis of the per-step
    metrics, and the losses with every option resolved."""

    def __init__(self) -> None:
        self._logged = False

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._logged:
            self._log(trainer, module, batch_inputs(batch))
            self._logged = True

    def _log(self, trainer: pl.Trainer, module: pl.LightningModule, x: torch.Tensor) -> None:
        if x.is_cuda:
            torch.cuda.reset_peak_memory_stats(x.device)
        # the forward and backward of the batch's objective, measured without changing the run; the backward as
        # autograd.grad, which accumulates nothing and so fires no DDP gradient hook outside a training step
        params = [p for p in module.parameters() if p.requires_grad]

        def step() -> None:
            loss = module.loss_terms(module.prepare_batch(x))["loss"]
            torch.autograd.grad(loss, params, allow_unused=True)

        facts = {"run/parameters": float(parameter_count(module))}
        try:
            facts["run/activation_memory_mb"] = step_activation_bytes(step, module) / 2**20
        except UnmeasurableStep as err:  # the run trains all the same, without the figure
            warnings.warn(f"run/activation_memory_mb is not logged: {err}", stacklevel=2)
        if x.is_cuda:
            facts["run/max_memory_allocated_mb"] = torch.cuda.max_memory_allocated(x.device) / 2**20
        losses = {k: repr(v) for k, v in vars(module).items() if isinstance(v, Loss)}
        if trainer.is_global_zero:  # logged once, straight to the loggers (not a per-step metric)
            for name, text in losses.items():
                rank_zero_info(f"{name}: {text}")
            for logger in trainer.loggers:
                # the step axis of the per-step metrics, which differs from global_step when a family steps several
                # optimisers
                logger.log_metrics(facts, step=batches_that_stepped(trainer))
                if losses:
                    logger.log_hyperparams({f"resolved_{k}": v for k, v in losses.items()})


class ClosingStage(pl.Callback):
    """After fit, a family's closing stage: the best checkpoint's weights are restored, the module's
    ``closing_stage(datamodule)`` runs, and the result is saved through the trainer as ``checkpoints/final.ckpt``.

    A fit resumed from a run whose training is done but has no ``final.ckpt`` runs the stage and says so. Families
    without a closing stage (``closing_stage`` None) and smoke runs (``fast_dev_run``) skip it."""

    def __init__(self) -> None:
        self._done = False

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._run(trainer, module)

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # Lightning calls no train hooks when the resumed fit loop is already done, but it does end the fit
        has_stage = getattr(module, "closing_stage", None) is not None
        if has_stage and not self._done and trainer.ckpt_path and not self.final_path(trainer).exists():
            rank_zero_info(f"training of this run is done but {self.final_path(trainer)} is missing: running the "
                           "closing stage")
            self._run(trainer, module)

    @staticmethod
    def final_path(trainer: pl.Trainer) -> Path:
        return run_dir(trainer) / "checkpoints" / "final.ckpt"

    def _run(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        stage = getattr(module, "closing_stage", None)
        datamodule = getattr(trainer, "datamodule", None)
        if stage is None or datamodule is None or trainer.fast_dev_run:
            return
        best = getattr(trainer.checkpoint_callback, "best_model_path", "")
        if best:
            state = torch.load(best, map_location=module.device, weights_only=True)["state_dict"]
            module.load_state_dict(state)
        stage(datamodule)
        if trainer.checkpoint_callback is not None:
            trainer.save_checkpoint(self.final_path(trainer))  # staged: a killed save leaves no partial file
        self._done = True


class SyncFreeSteps(pl.Callback):
    """Training steps with one host sync of deqscore's own: the module's finiteness guards (inputs, loss,
    gradients) and, at logging steps, the DEQ layers' convergence counts are read together before the update
    (``ScoreModule.sync_free_steps``; docs/method.md, "Sync-free training steps"). A non-finite step still
    raises before it reaches the weights. The DEQ solves are sync-free when their layers have ``check_every: 0``
    (fixed iteration counts); ``check_every: k`` keeps a host convergence test every k iterations.

    ``--trainer.callbacks+=deqscore.lightning.run_hooks.SyncFreeSteps``
    """

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        module.sync_free_steps = True

    def teardown(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        module.sync_free_steps = False
