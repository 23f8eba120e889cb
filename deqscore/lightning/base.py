"""Shared LightningModule for every model family: the family contract.

A family subclass, named by its declaration (:mod:`deqscore.families`), takes its plain ``nn.Module`` network
from the config (``model.init_args.net``, declared with its own options in ``deqscore/models/``) and implements

* :meth:`ScoreModule.compute_loss`: the per-sample training loss ``[B]``, or a dict of named per-sample terms
  whose ``"loss"`` entry is the objective (every term is logged);
* :meth:`ScoreModule.sample`: ``n`` samples in model space (``sample_images`` maps them to images through the
  data module's transform, ``sample_points`` points to the data's units through its whitening, both remembered in
  checkpoints);

and, where it needs them,

* :meth:`ScoreModule.eval_metrics`: extra validation/test numbers;
* :meth:`ScoreModule.prepare_batch`: per-step randomness of the inputs (binarisation, dequantisation);
* :meth:`ScoreModule.check_run`: refusals that depend on the trainer or the data (called before anything is
  written);
* several optimisers: :meth:`configure_optimizers` returns a list and :meth:`optimizer_steps` yields, per
  training batch, ``(optimiser index, term name, loss)`` in the order they are stepped (manual optimisation,
  done by the base);
* ``closing_stage(datamodule)``: a stage after fit, on the best weights, saved as ``checkpoints/final.ckpt``
  (the :class:`~deqscore.lightning.run_hooks.ClosingStage` callback).

The base provides one ``model_step`` shared by train/val/test, DEQ solver statistics, NaN guards, the
hyper-parameters a checkpoint needs to rebuild the module, and a family tag in checkpoints; its own callbacks
(:mod:`deqscore.lightning.run_hooks`) seed every step, fix resumes, log the run's facts and run the closing stage.
Optimisers come from LightningCLI's ``optimizer:``/``lr_scheduler:`` keys (a family with several optimisers
declares them in its own signature).

Sync-free training steps (``sync_free_steps``, switched on by the
:class:`~deqscore.lightning.run_hooks.SyncFreeSteps` callback): the finiteness checks of the step's inputs, loss
and gradients (:mod:`deqscore.finite`) and, at logging steps, the DEQ layers' deferred statistics are read
together by one host sync in :meth:`ScoreModule.on_before_optimizer_step`, before the update; per-step scalars
are logged as device tensors.

Score matching needs input gradients in validation and test too, so every step runs under
``torch.enable_grad()``; trainers must be built with ``inference_mode=False`` (inference mode cannot be
undone by ``enable_grad``), which the CLI sets.
"""

from __future__ import annotations

import importlib
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import pytorch_lightning as pl
import torch

from ..data.points import Whitening
from ..data.protocol import ImageData
from ..data.transforms import ImageCodec
from ..deq import DEQ, restore_warm_starts, set_aside_warm_starts
from ..errors import ConfigError
from ..families import declarations
from ..finite import DeferredChecks, deferred_checks
from ..losses import Loss
from ..privates import attached_trainer
from ..sampling.cost import counting_cost
from .nonfinite import NonFiniteStops
from .run_hooks import ClosingStage, ResumeFixes, RunFacts, StepSeeding, TrainingWarmStarts, batch_inputs

FAMILY_KEY = "deqscore_family"
CODEC_KEY = "deqscore_image_codec"
WHITENING_KEY = "deqscore_whitening"
DATA_KEY = "deqscore_data"

class CheckpointFamilyError(ValueError):
    """A checkpoint of one model family was loaded into another."""


def family_registry() -> dict[str, type[ScoreModule]]:
    """Model family name -> LightningModule class, from the class paths of the declarations (:mod:`deqscore.families`):
    a new family's module needs no registration and no import elsewhere."""
    return {name: _located(declared.module) for name, declared in declarations().items()}


def _located(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def family_of(cls: type) -> str:
    """The family of a module class: that of the nearest class in its ancestry a declaration names ('' for none)."""
    by_class = {registered: name for name, registered in family_registry().items()}
    return next((by_class[c] for c in cls.__mro__ if c in by_class), "")


def _plain(value: Any) -> bool:
    """A value a checkpoint can store and a config can restate (no modules, no loss objects)."""
    if isinstance(value, str | int | float | bool | type(None)):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


class ScoreModule(NonFiniteStops, pl.LightningModule):
    """Base class; subclasses take ``net`` (and their options) and implement the hooks."""

    #: the term of :meth:`compute_loss` that trains the DEQ layers' parameters (what their trust figures check)
    deq_objective: ClassVar[str] = "loss"
    #: one host sync per training step for deqscore's checks (see the module docstring); off: every check reads
    #: its own result at once, as a plain eager step does
    sync_free_steps: bool = False

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
        self.image_codec: ImageCodec | None = None
        self.whitening: Whitening | None = None  # point data: model space -> the data's units
        # the data module's class and the options that rebuild its data: where FID reference images, or the
        # held-out points of a point model's sample plot, come from after training
        self.data_source: dict[str, Any] | None = None

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

    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The inputs of one step from a batch's ``x`` (e.g. binarised afresh; the global RNG is seeded per step)."""
        return x

    def optimizer_steps(self, x: torch.Tensor) -> Iterator[tuple[int, str, Callable[[], torch.Tensor]]]:
        """With several optimisers: ``(optimiser index, term name, per-sample loss)`` of one training batch, in the
        order they are stepped; each loss is computed just before its step (after the previous update)."""
        raise NotImplementedError(f"{type(self).__name__} has several optimisers: implement optimizer_steps")

    closing_stage: Callable[[Any], None] | None = None  # a stage after fit, see the module docstring

    def configure_callbacks(self) -> list[pl.Callback]:
        return [StepSeeding(), TrainingWarmStarts(), ResumeFixes(), RunFacts(), ClosingStage()]

    # ----- samples as images -------------------------------------------------------------------------
    def datamodule(self) -> Any:
        """The data module of the attached trainer, or None (a module used on its own)."""
        trainer = attached_trainer(self)
        return getattr(trainer, "datamodule", None) if trainer is not None else None

    def check_run(self, trainer: pl.Trainer, datamodule: Any) -> None:
        """Raise ConfigError if this module cannot run with ``trainer`` and ``datamodule``; called before anything is
        written (and again by ``setup``, for trainers built in Python)."""

    def setup(self, stage: str) -> None:
        datamodule = self.datamodule()
        self.check_run(self.trainer, datamodule)
        if isinstance(datamodule, ImageData):  # remembered in checkpoints, so samples can be drawn without the data
            self.image_codec = datamodule.codec
            kind = type(datamodule)
            # with the options that rebuild the same images (a folder's image size, say)
            self.data_source = {"class_path": f"{kind.__module__}.{kind.__qualname__}",
                                "data_dir": str(datamodule.data_dir), **getattr(datamodule, "source_options", {})}
        elif datamodule is not None and hasattr(datamodule, "source_options"):  # point data
            kind = type(datamodule)
            self.data_source = {"class_path": f"{kind.__module__}.{kind.__qualname__}", **datamodule.source_options}
            self.whitening = getattr(datamodule, "whitening", None)

    @torch.no_grad()
    def sample_images(self, n: int) -> torch.Tensor:
        """``n`` samples as images ``[n, C, H, W]`` in [0, 1], undoing the data module's transform."""
        if self.image_codec is None:
            raise ConfigError(
                f"the {self.family!r} model has no image codec: it was not trained on an image data module "
                "(one with a `codec`), so its samples cannot be shown as images"
            )
        return self.image_codec.to_images(self.sample(n))

    @torch.no_grad()
    def sample_points(self, n: int) -> torch.Tensor:
        """``n`` samples ``[n, ...]`` in the data's units: undoing the data's whitening where it had one (the
        samples of a model of point data); model space otherwise."""
        x = self.sample(n)
        return x if self.whitening is None else self.whitening.to_data(x)

    # ----- shared machinery --------------------------------------------------------------------------
    def deq_layers(self) -> list[DEQ]:
        return [m for m in self.modules() if isinstance(m, DEQ)]

    @contextmanager
    def sampling_mode(self, warm: bool | None = None) -> Iterator[None]:
        """The network in eval mode, every DEQ layer from empty warm starts (the training's set aside and given back
        on exit: sampling never moves them) and, unless ``warm`` is None, its warm start set to ``warm`` (a
        sampler's consecutive evaluations move x a little); all restored on exit."""
        was_training = self.net.training
        layers = [] if warm is None else self.deq_layers()
        flags = [d.warm_start for d in layers]
        self.net.eval()
        kept = set_aside_warm_starts(self)
        for d in layers:
            d.warm_start = warm
        try:
            yield
        finally:
            self.net.train(was_training)
            restore_warm_starts(kept)
            for d, flag in zip(layers, flags, strict=True):
                d.warm_start = flag

    def sampling_cost(self, n: int = 16, seed: int = 0) -> dict[str, float]:
        """Network evaluations per sample and DEQ solver iterations per evaluation (summed over the DEQ layers),
        drawing ``n`` samples from ``seed`` with cold (zero) and warm starts; iterations per sample are their
        product (counted as ``sample.py`` counts them, :func:`deqscore.sampling.cost.counting_cost`). For a family
        whose ``sample`` takes ``warm`` (NCSN, EDM)."""
        out = {}
        for warm in (False, True):
            generator = torch.Generator(device=next(self.net.parameters()).device).manual_seed(seed)
            with counting_cost(self.net) as cost:
                self.sample(n, generator, warm=warm)
            key = "warm" if warm else "cold"
            out["evaluations_per_sample"] = float(cost.evaluations)  # one batch: each call evaluates every sample
            out[f"iterations_per_evaluation_{key}"] = cost.iterations_per_evaluation()
            out[f"iterations_per_sample_{key}"] = cost.iterations_per_evaluation() * cost.evaluations
        return out

    def check_image_shape(self, family: str) -> None:
        """ConfigError when the data's images are not of the network's ``image_shape``."""
        codec = self.image_codec
        if codec is not None and tuple(codec.image_shape) != self.net.image_shape:
            raise ConfigError(f"{family} net image shape {self.net.image_shape} differs from the data's "
                              f"{tuple(codec.image_shape)}: set net `channels` to the data's")

    def _deq_stats(self) -> dict[str, float | torch.Tensor]:
        stats = [d.stats for d in self.deq_layers() if d.stats is not None]
        if not stats:
            return {}
        # the adjoint solves, logged as deq/adjoint_*: backward="ift", its backward solve; "implicit", the last of
        # every nesting level (of the previous step's parameter gradient, and of this step's own input derivatives)
        adjoint = [s for d in self.deq_layers() for s in d.adjoint_stats.values()]
        return {**self._solve_stats(stats), **(self._solve_stats(adjoint, "deq/adjoint_") if adjoint else {}),
                **self._ift_stats()}

    def _ift_stats(self) -> dict[str, torch.Tensor]:
        """``deq/ift_backward_failures``: the fraction of IFT backward solves so far (since the start or the resume)
        that stopped at ``ift_max_iter`` without meeting ``ift_tol`` (kept on the device: no host sync)."""
        counts = [d.ift_counts for d in self.deq_layers() if d.ift_counts is not None]
        if not counts:
            return {}
        total = torch.stack(counts).sum(0)
        return {"deq/ift_backward_failures": total[1] / total[0]}

    @staticmethod
    def _solve_stats(stats: list, prefix: str = "deq/") -> dict[str, float | torch.Tensor]:
        if any(s.deferred for s in stats):  # device tensors (check_every != 1): logged without a host sync
            device = next(s.converged.device for s in stats if s.deferred)
            as_t = lambda v: torch.as_tensor(v, dtype=torch.float32).to(device)  # noqa: E731
            return {
                # a fill kernel, not a host-to-device copy (which would wait for the device)
                f"{prefix}nstep": torch.full((), sum(s.nstep for s in stats) / len(stats), device=device),
                f"{prefix}abs_residual": torch.stack([as_t(s.abs_residual) for s in stats]).max(),
                f"{prefix}rel_residual": torch.stack([as_t(s.rel_residual) for s in stats]).max(),
                f"{prefix}converged": torch.stack([as_t(s.converged) for s in stats]).min(),
            }
        return {
            f"{prefix}nstep": sum(s.nstep for s in stats) / len(stats),
            f"{prefix}abs_residual": max(s.abs_residual for s in stats),
            f"{prefix}rel_residual": max(s.rel_residual for s in stats),
            f"{prefix}converged": float(all(s.converged for s in stats)),
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
        x = self.prepare_batch(batch_inputs(batch))
        with torch.enable_grad():  # score matching differentiates w.r.t. x, also in validation/test
            terms = self.loss_terms(x)
            loss = terms["loss"]
            self.check_finite(loss, stage)
            deq_stats = self._deq_stats()  # of the model's own solve, before any metric solves again
            metrics = {} if stage == "train" else self.eval_metrics(x, stage, batch_idx)
        self.log_stage(stage, {**terms, **metrics, **deq_stats}, batch_size=x.shape[0])
        return loss

    def log_stage(self, stage: str, values: dict[str, Any], batch_size: int) -> None:
        """Log ``values`` under ``<stage>/``: per step in training, per epoch (synced across processes) else."""
        on_step = stage == "train"
        for name, value in values.items():
            value = value.detach() if isinstance(value, torch.Tensor) else value
            self.log(f"{stage}/{name}", value, prog_bar=name == "loss", on_step=on_step, on_epoch=not on_step,
                     batch_size=batch_size, sync_dist=not on_step)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.automatic_optimization:
            return self._manual_step(batch)
        if self._deferred_checks:  # kept until on_before_optimizer_step (across accumulated batches too)
            self._checks = self._checks if self._checks is not None else DeferredChecks()
            with deferred_checks(self._checks):
                loss = self.model_step(batch, "train", batch_idx)
        else:
            loss = self.model_step(batch, "train", batch_idx)
        # Parameters that do not affect the score (an energy's output bias, say) get no gradient from a
        # score-matching loss, and DDP's reducer fails on parameters outside the graph. A zero-weighted touch
        # puts them in the graph with an exact zero gradient.
        return loss + 0.0 * sum(p.reshape(-1)[0] for p in self.parameters() if p.requires_grad)

    def _manual_step(self, batch: Any) -> torch.Tensor:
        """One training batch of a family with several optimisers, stepped in :meth:`optimizer_steps` order; each
        term is logged as the mean of its steps' losses."""
        x = self.prepare_batch(batch_inputs(batch))
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        losses: dict[str, list[torch.Tensor]] = defaultdict(list)
        for index, name, loss_fn in self.optimizer_steps(x):
            if self._deferred_checks:  # read by the on_before_optimizer_step of this optimiser's step
                self._checks = DeferredChecks()
                with deferred_checks(self._checks):
                    loss = loss_fn().mean()
                    self.check_finite(loss, "train")
            else:
                loss = loss_fn().mean()
                self.check_finite(loss, "train")
            optimizers[index].zero_grad()
            self.manual_backward(loss)
            optimizers[index].step()
            losses[name].append(loss.detach())
        terms = {name: torch.stack(v).mean() for name, v in losses.items()}
        self.log_stage("train", {**terms, **self._deq_stats()}, batch_size=x.shape[0])  # stats: the last solve
        return losses["loss"][-1]

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model_step(batch, "val", batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model_step(batch, "test", batch_idx)

    def configure_optimizers(self) -> Any:
        # LightningCLI replaces this method by the config's `optimizer:` (and `lr_scheduler:`) keys
        raise ConfigError(
            "no optimizer configured: give `optimizer:` in the config (e.g. `--optimizer Adam --optimizer.lr 1e-4`), "
            "or override configure_optimizers when building the module in Python"
        )

    # ----- checkpoints ---------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        """The family's name (the checkpoint's family tag), from the declarations (:func:`family_of`)."""
        return family_of(type(self))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[FAMILY_KEY] = self.family
        if self.image_codec is not None:
            checkpoint[CODEC_KEY] = self.image_codec.as_dict()
        if self.data_source is not None:
            checkpoint[DATA_KEY] = dict(self.data_source)
        if self.whitening is not None:
            checkpoint[WHITENING_KEY] = self.whitening.as_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        found = checkpoint.get(FAMILY_KEY)
        if found != self.family:
            raise CheckpointFamilyError(
                f"checkpoint holds a {found!r} model, not {self.family!r}; load it with the "
                f"{found!r} module (sample.py picks the family from the checkpoint)"
            )
        self._check_shapes(checkpoint)
        if checkpoint.get(CODEC_KEY) is not None:
            self.image_codec = ImageCodec.from_dict(checkpoint[CODEC_KEY])
        if checkpoint.get(DATA_KEY) is not None:
            self.data_source = dict(checkpoint[DATA_KEY])
        if checkpoint.get(WHITENING_KEY) is not None:
            self.whitening = Whitening.from_dict(checkpoint[WHITENING_KEY])

    def _check_shapes(self, checkpoint: dict[str, Any]) -> None:
        """ConfigError naming both sizes when the checkpoint's weights do not fit this module (e.g. a network
        trained on data of another dimension), instead of a state-dict traceback."""
        own = self.state_dict()
        wrong = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in checkpoint.get("state_dict", {}).items()
                 if k in own and tuple(v.shape) != tuple(own[k].shape)]
        if not wrong:
            return
        key, saved, here = wrong[0]
        net = checkpoint.get("hyper_parameters", {}).get("net")
        saved_dim = net.get("init_args", {}).get("dim") if isinstance(net, dict) else None
        this_dim = getattr(getattr(self, "net", None), "dim", None)
        dims = f": the checkpoint's network has dim {saved_dim}, this run's data dim {this_dim}" if (
            saved_dim is not None and this_dim is not None and saved_dim != this_dim) else ""
        raise ConfigError(
            f"the checkpoint does not fit this {self.family!r} model{dims} ({key} has shape {saved} in the checkpoint, "
            f"{here} here; {len(wrong)} weight(s) differ); resume on the data and with the network options the "
            "checkpoint was trained with"
        )
