"""Shared LightningModule for every model family.

A family subclass takes its plain ``nn.Module`` network from the config (``model.init_args.net``, declared
with its own options in ``deqscore/models/``), builds its loss objects and implements

* :meth:`ScoreModule.compute_loss`: the per-sample training loss ``[B]``, or a dict of named per-sample terms
  whose ``"loss"`` entry is the objective (every term is logged);
* :meth:`ScoreModule.eval_metrics`: extra validation/test numbers;
* :meth:`ScoreModule.sample`: ``n`` samples in model space (``sample_images`` maps them to images through the
  data module's transform, remembered in checkpoints).

The base class provides one ``model_step`` shared by train/val/test, DEQ solver statistics, the parameter count
and activation memory, NaN guards, the hyper-parameters a checkpoint needs to rebuild the module, and a family
tag in checkpoints. Optimisers come from LightningCLI's ``optimizer:``/``lr_scheduler:`` keys; a family with
several optimisers overrides :meth:`configure_optimizers` (and ``training_step``, with manual optimisation).

Score matching needs input gradients in validation and test too, so every step runs under
``torch.enable_grad()``; trainers must be built with ``inference_mode=False`` (inference mode cannot be
undone by ``enable_grad``), which the CLI and the configs set.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, ClassVar

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from ..data.transforms import ImageCodec
from ..deq import DEQ
from ..errors import ConfigError
from ..losses import Loss
from ..metrics import SavedTensorMeter, parameter_count

FAMILY_KEY = "deqscore_family"
CODEC_KEY = "deqscore_image_codec"
DATA_KEY = "deqscore_data"

_FAMILIES: dict[str, type[ScoreModule]] = {}


class NonFiniteLossError(FloatingPointError):
    """A NaN/Inf loss or gradient: training stops before the parameters are touched."""


class CheckpointFamilyError(ValueError):
    """A checkpoint of one model family was loaded into another."""


def _inputs(batch: Any) -> torch.Tensor:
    """The model input of a batch: ``x`` or the first element of ``(x, label, ...)``."""
    return batch[0] if isinstance(batch, list | tuple) else batch


def complete_finished_epoch(checkpoint: dict[str, Any]) -> bool:
    """Mark an epoch whose batches all ran (saved from its end hooks) as completed in ``checkpoint``'s loop state.

    Lightning 2.6 resumes such a checkpoint of a run with ``max_steps`` set by replaying the epoch's end: its
    hooks run a second time, the epoch is counted twice (a resumed ``max_epochs: 2`` run stops at once) and the
    data order of every later epoch shifts. Without ``max_steps`` it marks the epoch completed and goes on; this
    gives both kinds of run that behaviour (with :meth:`ScoreModule.on_train_epoch_start`, which starts the next
    epoch afresh rather than as a restart). True if the checkpoint was such a one.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    if not fit_loop or not fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch"):
        return False
    progress = fit_loop["epoch_progress"]
    trackers = (progress["total"], progress["current"])
    if not all(t["ready"] == t["started"] == t["processed"] == t["completed"] + 1 for t in trackers):
        return False
    for tracker in trackers:
        tracker["completed"] = tracker["processed"]
    return True


def family_registry() -> dict[str, type[ScoreModule]]:
    """Model family name -> LightningModule class."""
    return dict(_FAMILIES)


def _plain(value: Any) -> bool:
    """A value a checkpoint can store and a config can restate (no modules, no loss objects)."""
    if isinstance(value, str | int | float | bool | type(None)):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


class ScoreModule(pl.LightningModule):
    """Base class; subclasses set ``family``, take ``net`` (and their options) and implement the hooks."""

    family: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("family"):  # only classes that name a family themselves, not their subclasses
            _FAMILIES[cls.family] = cls

    def __init__(self) -> None:
        super().__init__()
        # Built by the CLI or load_module, the hyper-parameters are the config itself (nested class_path/init_args),
        # enough to rebuild the module from its checkpoint. Built in Python from objects, those objects are left out.
        frame = inspect.currentframe()
        self.save_hyperparameters(frame=frame.f_back if frame else None)
        for key, value in list(self.hparams.items()):
            if isinstance(value, Loss):
                self.hparams[key] = value.config()
            elif not _plain(value):
                del self.hparams[key]
        self._run_facts_logged = False
        self._resumed_after_epoch = False  # see complete_finished_epoch
        self.image_codec: ImageCodec | None = None
        # the image data module's class and data folder: where FID reference images come from after training
        self.data_source: dict[str, str] | None = None

    # ----- to implement per family -------------------------------------------------------------------
    def compute_loss(self, x: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """Per-sample training loss ``[B]``, or named per-sample terms with the objective under ``"loss"``."""
        raise NotImplementedError

    def eval_metrics(self, x: torch.Tensor, stage: str, batch_idx: int) -> dict[str, torch.Tensor]:
        """Extra validation/test metrics for one batch (means over the batch)."""
        return {}

    def sample(self, n: int) -> torch.Tensor:
        """``n`` samples from the model, in the model's (data module's transformed) space."""
        raise NotImplementedError(f"the {self.family!r} family does not draw samples")

    # ----- samples as images -------------------------------------------------------------------------
    def datamodule(self) -> Any:
        """The data module of the attached trainer, or None (a module used on its own)."""
        return getattr(self._trainer, "datamodule", None) if self._trainer is not None else None

    def check_run(self, trainer: pl.Trainer, datamodule: Any) -> None:
        """Raise ConfigError if this module cannot run with ``trainer`` and ``datamodule`` (e.g. an unsuitable
        strategy or data transform). The CLI calls it, and every callback's ``check_run``, before anything is
        written; ``setup`` calls it again for trainers built in Python."""

    def setup(self, stage: str) -> None:
        datamodule = self.datamodule()
        self.check_run(self.trainer, datamodule)
        codec = getattr(datamodule, "codec", None)
        if codec is not None:  # remembered in checkpoints, so samples can be drawn without the data
            self.image_codec = codec
            kind = type(datamodule)
            self.data_source = {"class_path": f"{kind.__module__}.{kind.__qualname__}",
                                "data_dir": str(getattr(datamodule, "data_dir", "datasets"))}

    @torch.no_grad()
    def sample_images(self, n: int) -> torch.Tensor:
        """``n`` samples as images ``[n, C, H, W]`` in [0, 1], undoing the data module's transform."""
        if self.image_codec is None:
            raise ConfigError(
                f"the {self.family!r} model has no image codec: it was not trained on an image data module "
                "(one with a `codec`), so its samples cannot be shown as images"
            )
        return self.image_codec.to_images(self.sample(n))

    # ----- shared machinery --------------------------------------------------------------------------
    def deq_layers(self) -> list[DEQ]:
        return [m for m in self.modules() if isinstance(m, DEQ)]

    def refuse_ift(self, derivatives: int, loss: object) -> None:
        """Raise if a DEQ layer uses ``backward="ift"`` while the loss differentiates through it ``derivatives``
        more times than once: the IFT backward would give silently wrong parameter gradients."""
        if derivatives > 0 and any(d.backward == "ift" for d in self.deq_layers()):
            raise ConfigError(
                f"DEQ backward='ift' gives wrong parameter gradients for the loss {loss!r}: it differentiates "
                "through the DEQ twice (docs/method.md section 2.5); use backward='phantom' or 'unroll', or a "
                "first-order loss"
            )

    def _deq_stats(self) -> dict[str, float]:
        stats = [d.stats for d in self.deq_layers() if d.stats is not None]
        if not stats:
            return {}
        return {
            "deq/nstep": sum(s.nstep for s in stats) / len(stats),
            "deq/abs_residual": max(s.abs_residual for s in stats),
            "deq/rel_residual": max(s.rel_residual for s in stats),
            "deq/converged": float(all(s.converged for s in stats)),
        }

    def loss_terms(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Batch means of the training objective's terms; ``"loss"`` is the objective."""
        terms = self.compute_loss(x)
        terms = terms if isinstance(terms, dict) else {"loss": terms}
        if "loss" not in terms:
            raise KeyError(f"{type(self).__name__}.compute_loss returned terms {sorted(terms)} without 'loss'")
        return {name: value.mean() for name, value in terms.items()}

    def model_step(self, batch: Any, stage: str, batch_idx: int = 0) -> torch.Tensor:
        """Loss (and, outside training, metrics) of one batch; logs under ``<stage>/``."""
        x = _inputs(batch)
        with torch.enable_grad():  # score matching differentiates w.r.t. x, also in validation/test
            terms = self.loss_terms(x)
            loss = terms["loss"]
            self.check_finite(loss, stage)
            deq_stats = self._deq_stats()  # of the model's own solve, before any metric solves again
            metrics = {} if stage == "train" else self.eval_metrics(x, stage, batch_idx)
        self.log_stage(stage, {**terms, **metrics, **deq_stats}, batch_size=x.shape[0])
        return loss

    def check_finite(self, loss: torch.Tensor, stage: str) -> None:
        """Raise :class:`NonFiniteLossError` for a NaN/Inf loss, before any update."""
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"non-finite {stage} loss ({loss.item()}) at global step {self.global_step}, epoch "
                f"{self.current_epoch}: training stopped before the update, last good checkpoint kept"
            )

    def log_stage(self, stage: str, values: dict[str, Any], batch_size: int) -> None:
        """Log ``values`` under ``<stage>/``: per step in training, per epoch (synced across processes) else."""
        on_step = stage == "train"
        for name, value in values.items():
            value = value.detach() if isinstance(value, torch.Tensor) else value
            self.log(f"{stage}/{name}", value, prog_bar=name == "loss", on_step=on_step, on_epoch=not on_step,
                     batch_size=batch_size, sync_dist=not on_step)

    def _reseed(self, offset: int) -> None:
        """Seed the global RNG from (run seed, offset, rank): the random draws of a step (projections, noise)
        then depend on the step alone, so a resumed run repeats an uninterrupted one exactly."""
        base = int(os.environ.get("PL_GLOBAL_SEED", 0))
        torch.manual_seed((base * 1_000_003 + offset * 7919 + self.global_rank) % 2**63)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # with gradient accumulation several batches share a global step; each gets its own draws
        accumulate = self.trainer.accumulate_grad_batches
        self._reseed(self.global_step * accumulate + batch_idx % accumulate)

    def on_validation_epoch_start(self) -> None:
        self._reseed(-1)  # the same draws at every validation, so epochs are comparable

    def on_test_epoch_start(self) -> None:
        self._reseed(-2)

    def on_train_epoch_start(self) -> None:
        if self._resumed_after_epoch:  # a fresh epoch after a finished one, not the restart of an unfinished one
            self.trainer.fit_loop.epoch_loop.restarting = False
            self._resumed_after_epoch = False
        # data modules with epoch-dependent randomness (dequantisation noise, shuffling) follow the epoch
        if hasattr(self.datamodule(), "set_epoch"):
            self.datamodule().set_epoch(self.current_epoch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self._run_facts_logged:
            self._log_run_facts(batch)
        loss = self.model_step(batch, "train", batch_idx)
        # Parameters that do not affect the score (an energy's output bias, say) get no gradient from a
        # score-matching loss, and DDP's reducer fails on parameters outside the graph. A zero-weighted touch
        # puts them in the graph with an exact zero gradient.
        return loss + 0.0 * sum(p.reshape(-1)[0] for p in self.parameters() if p.requires_grad)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model_step(batch, "val", batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model_step(batch, "test", batch_idx)

    def _log_run_facts(self, batch: Any) -> None:
        """Once per run: parameter count and activation memory of one training step (its loss graph)."""
        x = _inputs(batch)
        if x.is_cuda:
            torch.cuda.reset_peak_memory_stats(x.device)
        # forked RNG and restored buffers (batch-norm statistics): the measurement must not change the step itself,
        # nor make a resumed run (which measures again) differ from one that ran straight through
        buffers = {name: b.clone() for name, b in self.named_buffers()}
        with torch.random.fork_rng(), SavedTensorMeter(exclude=self.parameters()) as meter, torch.enable_grad():
            self.loss_terms(x)
        with torch.no_grad():
            for name, b in self.named_buffers():
                b.copy_(buffers[name])
        facts = {"run/parameters": float(parameter_count(self)), "run/activation_memory_mb": meter.bytes / 2**20}
        if x.is_cuda:
            facts["run/max_memory_allocated_mb"] = torch.cuda.max_memory_allocated(x.device) / 2**20
        # the losses with every option resolved (e.g. which DSM weighting), beside the config's short names
        losses = {k: repr(v) for k, v in vars(self).items() if isinstance(v, Loss)}
        if self.trainer.is_global_zero:  # logged once, straight to the loggers (not a per-step metric)
            for name, text in losses.items():
                rank_zero_info(f"{name}: {text}")
            for logger in self.loggers:
                logger.log_metrics(facts, step=self.global_step)
                if losses:
                    logger.log_hyperparams({f"resolved_{k}": v for k, v in losses.items()})
        self._run_facts_logged = True

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        named = [(name, p.grad) for name, p in self.named_parameters() if p.grad is not None]
        finite = torch.stack([torch.isfinite(g).all() for _, g in named]) if named else torch.ones(0, dtype=bool)
        if not bool(finite.all()):  # one device sync per step
            bad = [name for (name, _), ok in zip(named, finite.tolist(), strict=True) if not ok]
            raise NonFiniteLossError(
                f"non-finite gradient of {bad} at global step {self.global_step}: training stopped before the "
                "update, last good checkpoint kept"
            )

    def configure_optimizers(self) -> Any:
        # LightningCLI replaces this method by the config's `optimizer:` (and `lr_scheduler:`) keys
        raise ConfigError(
            "no optimizer configured: give `optimizer:` in the config (e.g. `--optimizer Adam --optimizer.lr 1e-4`), "
            "or override configure_optimizers when building the module in Python"
        )

    # ----- checkpoints ---------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[FAMILY_KEY] = self.family
        if self.image_codec is not None:
            checkpoint[CODEC_KEY] = self.image_codec.as_dict()
        if self.data_source is not None:
            checkpoint[DATA_KEY] = dict(self.data_source)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        found = checkpoint.get(FAMILY_KEY)
        if found != self.family:
            raise CheckpointFamilyError(
                f"checkpoint holds a {found!r} model, not {self.family!r}; load it with the "
                f"{found!r} module (sample.py picks the family from the checkpoint)"
            )
        if checkpoint.get(CODEC_KEY) is not None:
            self.image_codec = ImageCodec.from_dict(checkpoint[CODEC_KEY])
        if checkpoint.get(DATA_KEY) is not None:
            self.data_source = dict(checkpoint[DATA_KEY])
        self._resumed_after_epoch = complete_finished_epoch(checkpoint)
