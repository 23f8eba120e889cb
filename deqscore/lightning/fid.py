"""``FIDCallback``: FID of model samples against the training set's statistics during training.

Every ``every_n_epochs`` epochs, at the start of validation (so with the averaged weights when an
``EMAWeightAveraging`` callback is listed before it), every process draws its share of ``num_samples`` images with
:meth:`ScoreModule.sample_images`, computes their Inception features, and the feature sums are added across
processes (DDP), so the FID is that of all ``num_samples`` images whatever the number of processes. It is logged as
``val/fid`` with ``val/fid_samples`` (the N it was computed with: FIDs are comparable only at equal N and
reference statistics) and the KID of the same features as ``val/kid`` and ``val/kid_std``
(:class:`deqscore.metrics.quality.SampleFeatures`, the accumulator ``sample.py --fid`` uses too), a grid of the
first samples is saved as ``<run>/fid/epoch_<e>.png``, and the checkpoint of the lowest FID so far is kept as
``<run>/checkpoints/best-fid.ckpt`` (written after validation, with the trained and averaged weights in their usual
places).

The reference statistics are those of the data module's training split
(:func:`deqscore.metrics.reference.dataset_stats`), computed once and cached under ``stats_root``.

Config::

    trainer:
      callbacks:
        - class_path: deqscore.lightning.EMAWeightAveraging
          init_args: {decay: 0.999}
        - class_path: deqscore.lightning.FIDCallback
          init_args: {every_n_epochs: 10, num_samples: 1000}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import WeightAveraging

from ..errors import ConfigError, check_count
from ..metrics.inception import InceptionFeatures
from ..metrics.quality import SampleFeatures
from ..metrics.reference import dataset_stats
from ..metrics.statistics import GaussianStats
from ..sampling import save_image_grid
from .callbacks import run_dir

BEST_FID_FILE = "best-fid.ckpt"


def _share(n: int, rank: int, world: int) -> int:
    """Samples drawn by process ``rank`` of ``world``: ``n`` split as evenly as possible."""
    return n // world + (1 if rank < n % world else 0)


class FIDCallback(pl.Callback):
    """FID of ``num_samples`` model samples every ``every_n_epochs`` epochs; see the module docstring.

    Args:
        every_n_epochs: epochs between two FID evaluations.
        num_samples: N, the samples per evaluation (all processes together).
        batch_size: samples drawn (and images embedded) per call on each process.
        reference_images: training images used for the reference statistics (None: the whole split).
        stats_root: folder of the cached reference statistics.
        inception_weights: path of the FID Inception weights (None: resolved as :class:`InceptionFeatures` does).
        grid_size: samples saved in the grid (0: none).
        seed: base seed of the samples (with the epoch and the process rank), so evaluations are repeatable.
    """

    def __init__(
        self,
        every_n_epochs: int = 1,  # epochs between two evaluations
        num_samples: int = 1000,  # N per evaluation, all processes together
        batch_size: int = 250,  # samples drawn per call on each process
        reference_images: int | None = None,  # training images for the reference statistics (None: all)
        stats_root: str = "datasets/fid_stats",  # cache of reference statistics
        inception_weights: str | None = None,  # FID Inception weights (None: resolved automatically)
        grid_size: int = 64,  # samples saved as a PNG grid per evaluation
        seed: int = 0,  # with (epoch, rank): the samples' seed
    ):
        check_count("FIDCallback every_n_epochs", every_n_epochs)
        check_count("FIDCallback num_samples", num_samples, low=2, why=" (a covariance needs two samples)")
        check_count("FIDCallback batch_size", batch_size)
        check_count("FIDCallback grid_size", grid_size, low=0)
        if reference_images is not None:
            check_count("FIDCallback reference_images", reference_images, low=2)
        self.every_n_epochs, self.num_samples, self.batch_size = every_n_epochs, num_samples, batch_size
        self.reference_images, self.stats_root, self.inception_weights = reference_images, stats_root, inception_weights
        self.grid_size, self.seed = grid_size, seed
        self.best_fid = float("inf")
        self._new_best = False
        self._features: InceptionFeatures | None = None
        self._reference: GaussianStats | None = None  # read (or computed) once per run, not at every evaluation

    # ----- checks and state -------------------------------------------------------------------------------
    def check_run(self, trainer: pl.Trainer, datamodule: Any) -> None:
        """ConfigError unless the averaged weights are in place when FID is computed (the CLI calls this before
        anything is written; ``setup`` again, for trainers built in Python)."""
        callbacks = trainer.callbacks
        mine = callbacks.index(self)
        late = [type(c).__name__ for c in callbacks[mine + 1 :] if isinstance(c, WeightAveraging)]
        if late:
            raise ConfigError(f"trainer.callbacks: list FIDCallback after {late[0]}: FID is computed at the start of "
                              "validation, once the averaged weights are swapped in")

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self.check_run(trainer, trainer.datamodule)

    def state_dict(self) -> dict[str, Any]:
        return {"best_fid": self.best_fid}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_fid = float(state_dict["best_fid"])

    # ----- the evaluation ---------------------------------------------------------------------------------
    def _due(self, trainer: pl.Trainer) -> bool:
        return not trainer.sanity_checking and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def features(self, device: torch.device) -> InceptionFeatures:
        if self._features is None:
            self._features = InceptionFeatures(self.inception_weights)
        return self._features.to(device)

    def sample_stats(self, trainer: pl.Trainer, module: pl.LightningModule) -> tuple[SampleFeatures, torch.Tensor]:
        """The features of this process's share of the samples (their statistics summed over processes) and its
        first images."""
        left = _share(self.num_samples, trainer.global_rank, trainer.world_size)
        features, grid = SampleFeatures(self.features(module.device)), []
        was_training = module.training
        module.eval()
        with torch.random.fork_rng(devices=[module.device] if module.device.type == "cuda" else []):
            torch.manual_seed(self.seed + 1_000_003 * trainer.current_epoch + 7919 * trainer.global_rank)
            while left > 0:
                images = module.sample_images(min(self.batch_size, left))
                features.add(images)
                if sum(len(g) for g in grid) < self.grid_size:
                    grid.append(images[: self.grid_size].cpu())
                left -= len(images)
        module.train(was_training)
        features.stats.all_reduce()
        return features, torch.cat(grid)[: self.grid_size] if grid else torch.empty(0)

    def on_validation_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not self._due(trainer):
            return
        if self._reference is None:
            self._reference = dataset_stats(
                trainer.datamodule, train=True, max_images=self.reference_images, root=self.stats_root,
                extractor=self.features(module.device), barrier=trainer.strategy.barrier,
                is_writer=trainer.is_global_zero)
        features, grid = self.sample_stats(trainer, module)
        quality = features.quality(self._reference, seed=self.seed)
        fid = quality["fid"]
        # the same values on every process
        module.log("val/fid", fid, on_epoch=True, sync_dist=False)
        module.log("val/fid_samples", float(self.num_samples), on_epoch=True, sync_dist=False)
        if quality["kid"] is not None:
            module.log("val/kid", quality["kid"], on_epoch=True, sync_dist=False)
            module.log("val/kid_std", quality["kid_std"], on_epoch=True, sync_dist=False)
        if trainer.is_global_zero and len(grid):
            save_image_grid(grid, run_dir(trainer) / "fid" / f"epoch_{trainer.current_epoch:04d}.png")
        self._new_best = fid < self.best_fid
        self.best_fid = min(fid, self.best_fid)

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # after validation the trained and averaged weights are back in place for the checkpoint
        if self._new_best:
            self._new_best = False
            trainer.save_checkpoint(Path(run_dir(trainer)) / "checkpoints" / BEST_FID_FILE)
