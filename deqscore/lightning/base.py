"""Shared LightningModule for every model family.

A family subclass builds its plain ``nn.Module`` network in ``__init__`` (``self.net``) and implements
:meth:`ScoreModule.compute_loss` (per-sample training loss) and :meth:`ScoreModule.eval_metrics` (extra
validation/test numbers). This base class provides the rest: one ``model_step`` shared by train/val/test,
logging of DEQ solver statistics, parameter count and activation memory, NaN guards, the optimiser, and a
family tag in checkpoints so that loading a checkpoint of another family fails clearly.

Score matching needs input gradients in validation and test too, so every step runs under
``torch.enable_grad()``; trainers must be built with ``inference_mode=False`` (inference mode cannot be
undone by ``enable_grad``), which the CLI and the configs set.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytorch_lightning as pl
import torch

from ..deq import DEQ
from ..metrics import SavedTensorMeter, parameter_count

FAMILY_KEY = "deqscore_family"
OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop}

_FAMILIES: dict[str, type[ScoreModule]] = {}


class NonFiniteLossError(FloatingPointError):
    """A NaN/Inf loss or gradient: training stops before the parameters are touched."""


class CheckpointFamilyError(ValueError):
    """A checkpoint of one model family was loaded into another."""


def _inputs(batch: Any) -> torch.Tensor:
    """The model input of a batch: ``x`` or the first element of ``(x, label, ...)``."""
    return batch[0] if isinstance(batch, list | tuple) else batch


def family_registry() -> dict[str, type[ScoreModule]]:
    """Model family name -> LightningModule class."""
    return dict(_FAMILIES)


class ScoreModule(pl.LightningModule):
    """Base class; subclasses set ``family`` and build ``self.net``."""

    family: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("family"):  # only classes that name a family themselves, not their subclasses
            _FAMILIES[cls.family] = cls

    def __init__(self, lr: float = 1e-4, weight_decay: float = 0.0, optimizer: str = "adam"):
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {tuple(OPTIMIZERS)}")
        self.lr, self.weight_decay, self.optimizer_name = lr, weight_decay, optimizer
        self._activation_memory_logged = False

    # ----- to implement per family -------------------------------------------------------------------
    def compute_loss(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sample training loss ``[B]`` on a batch of inputs."""
        raise NotImplementedError

    def eval_metrics(self, x: torch.Tensor, stage: str, batch_idx: int) -> dict[str, torch.Tensor]:
        """Extra validation/test metrics for one batch (means over the batch)."""
        return {}

    # ----- shared machinery --------------------------------------------------------------------------
    def deq_layers(self) -> list[DEQ]:
        return [m for m in self.modules() if isinstance(m, DEQ)]

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

    def model_step(self, batch: Any, stage: str, batch_idx: int = 0) -> torch.Tensor:
        """Loss (and, outside training, metrics) of one batch; logs under ``<stage>/``."""
        x = _inputs(batch)
        with torch.enable_grad():  # score matching differentiates w.r.t. x, also in validation/test
            loss = self.compute_loss(x).mean()
            if not torch.isfinite(loss):
                raise NonFiniteLossError(
                    f"non-finite {stage} loss ({loss.item()}) at global step {self.global_step}, epoch "
                    f"{self.current_epoch}: training stopped before the update, last good checkpoint kept"
                )
            metrics = {} if stage == "train" else self.eval_metrics(x, stage, batch_idx)
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss.detach(), prog_bar=True, on_step=on_step, on_epoch=not on_step,
                 batch_size=x.shape[0], sync_dist=not on_step)
        for name, value in {**metrics, **self._deq_stats()}.items():
            self.log(f"{stage}/{name}", value, on_step=on_step, on_epoch=not on_step, batch_size=x.shape[0],
                     sync_dist=not on_step)
        return loss

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
        # data modules with epoch-dependent randomness (dequantisation noise, shuffling) follow the epoch
        datamodule = getattr(self.trainer, "datamodule", None)
        if hasattr(datamodule, "set_epoch"):
            datamodule.set_epoch(self.current_epoch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self._activation_memory_logged:
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
        # forked RNG: the measurement must not shift the random draws of the step itself
        with torch.random.fork_rng(), SavedTensorMeter(exclude=self.parameters()) as meter, torch.enable_grad():
            self.compute_loss(x).mean()
        facts = {"run/parameters": float(parameter_count(self)), "run/activation_memory_mb": meter.bytes / 2**20}
        if x.is_cuda:
            facts["run/max_memory_allocated_mb"] = torch.cuda.max_memory_allocated(x.device) / 2**20
        if self.trainer.is_global_zero:  # logged once, straight to the loggers (not a per-step metric)
            for logger in self.loggers:
                logger.log_metrics(facts, step=self.global_step)
        self._activation_memory_logged = True

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        named = [(name, p.grad) for name, p in self.named_parameters() if p.grad is not None]
        finite = torch.stack([torch.isfinite(g).all() for _, g in named]) if named else torch.ones(0, dtype=bool)
        if not bool(finite.all()):  # one device sync per step
            bad = [name for (name, _), ok in zip(named, finite.tolist(), strict=True) if not ok]
            raise NonFiniteLossError(
                f"non-finite gradient of {bad} at global step {self.global_step}: training stopped before the "
                "update, last good checkpoint kept"
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer_name](self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    # ----- checkpoints ---------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[FAMILY_KEY] = self.family

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        found = checkpoint.get(FAMILY_KEY)
        if found != self.family:
            raise CheckpointFamilyError(
                f"checkpoint holds a {found!r} model, not {self.family!r}; load it with the "
                f"{found!r} module (sample.py picks the family from the checkpoint)"
            )
