"""``MNISTDataModule``: dequantised MNIST as 784-d vectors for density models (METHOD.md §4.1).

MNIST-train is split 90% / 10% into train / val with a fixed numpy seed (2019, as the reference code:
``np.random.seed(2019); np.random.shuffle(indices)``); MNIST-test is the test set. Train items get fresh
dequantisation noise every epoch and a fresh shuffle, both drawn from generators seeded by (epoch, item), so a
resumed run sees exactly the data an uninterrupted one would (whatever the workers or processes); val/test
items get noise from a generator seeded by the item's index, so evaluation metrics are reproducible.

Config use (LightningCLI)::

    data:
      class_path: deqscore.data.MNISTDataModule
      init_args: {batch_size: 128, transform: logit, use_lmdb: false}

>>> dm = MNISTDataModule(train_subset=256, val_subset=64, test_subset=64)  # doctest: +SKIP
>>> dm.prepare_data(); dm.setup("fit")                                      # doctest: +SKIP
>>> x, y = next(iter(dm.train_dataloader())); x.shape                       # doctest: +SKIP
torch.Size([128, 784])
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from deqscore.data.lmdb_cache import LMDBImageDataset, build_lmdb_cache, lmdb_cache_info
from deqscore.data.mnist import load_mnist
from deqscore.data.transforms import (
    DEFAULT_ALPHA,
    bits_per_dim,
    check_transform,
    inverse_logit,
    preprocess,
    to_unit,
)

__all__ = ["ArrayImageDataset", "MNISTDataModule", "PreprocessedImageDataset", "split_indices"]

# Seed offsets of the deterministic evaluation noise (seed = offset + index into MNIST-train / MNIST-test).
_VAL_NOISE_SEED = 1_000_000
_TEST_NOISE_SEED = 2_000_000
_TRAIN_NOISE_SEED = 3_000_000  # + epoch * _EPOCH_STRIDE + index
_EPOCH_STRIDE = 10_000_000
_LOCAL_SOURCES = ("torchvision", "pureml")  # never download outside prepare_data


def split_indices(n: int, val_fraction: float = 0.1, seed: int = 2019) -> tuple[np.ndarray, np.ndarray]:
    """Train/val index split of ``range(n)`` as the reference code does it.

    ``np.random.seed(seed); np.random.shuffle(indices)`` (reproduced with a private ``RandomState``, leaving
    the global numpy state untouched); the first ``int(n * (1 - val_fraction))`` shuffled indices train, the
    rest validate.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    indices = np.arange(n)
    np.random.RandomState(seed).shuffle(indices)
    n_train = int(n * (1.0 - val_fraction))
    return indices[:n_train], indices[n_train:]


class ArrayImageDataset(Dataset):
    """In-memory ``(uint8 image tensor, int label)`` dataset over numpy arrays."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = torch.from_numpy(np.ascontiguousarray(images))
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


class PreprocessedImageDataset(Dataset):
    """Items ``(x float32 [D], label)`` of ``base[indices[i]]`` after dequantisation and ``transform``.

    Args:
        base: dataset of ``(uint8 image tensor, int label)``.
        indices: which items of ``base`` to expose, in order.
        transform: one of :data:`deqscore.data.transforms.TRANSFORMS`.
        alpha: clamp/squeeze margin.
        noise_seed: None for fresh noise on every read; an int for deterministic noise from a generator
            seeded with ``noise_seed + base_index`` (evaluation).
        per_epoch: add ``epoch * 10^7`` to that seed, the epoch being set by :meth:`set_epoch` (training):
            fresh noise every epoch, reproducible across resumes and DataLoader workers.
    """

    def __init__(
        self,
        base: Dataset,
        indices: np.ndarray,
        transform: str = "logit",
        alpha: float = DEFAULT_ALPHA,
        noise_seed: int | None = None,
        per_epoch: bool = False,
    ) -> None:
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.transform = check_transform(transform)
        self.alpha = alpha
        self.noise_seed = noise_seed
        self.per_epoch = per_epoch
        # shared memory, so persistent DataLoader workers see the epoch the main process sets
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        base_index = int(self.indices[index])
        image, label = self.base[base_index]
        generator = None
        if self.noise_seed is not None:
            epoch_offset = int(self._epoch) * _EPOCH_STRIDE if self.per_epoch else 0
            generator = torch.Generator().manual_seed(self.noise_seed + epoch_offset + base_index)
        x = preprocess(image.reshape(-1), self.transform, self.alpha, generator)
        return x, int(label)


class EpochShuffleSampler(torch.utils.data.Sampler[int]):
    """Random permutation of ``range(n)`` drawn from ``seed + epoch``: reproducible per epoch, so resuming
    mid-training repeats the order an uninterrupted run would use. Lightning calls :meth:`set_epoch`."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())

    def __len__(self) -> int:
        return self.n


class MNISTDataModule(pl.LightningDataModule):
    """Dequantised MNIST as flattened 784-d vectors (METHOD.md §4.1).

    Args:
        data_dir: data root: torchvision files under ``<data_dir>/MNIST/raw``, downloads and the LMDB cache
            (``<data_dir>/mnist_lmdb/{train,test}``) go here.
        batch_size: training batch size.
        eval_batch_size: val/test batch size (default ``batch_size``).
        num_workers: DataLoader workers (persistent when > 0).
        val_fraction: fraction of MNIST-train held out for validation.
        split_seed: numpy seed of the train/val split (2019 as the reference code).
        train_subset: keep only the first n training items after the split (quick demos/tests).
        val_subset: same for validation.
        test_subset: same for the test set.
        use_lmdb: read images from an LMDB cache built once under ``<data_dir>/mnist_lmdb/``.
        transform: ``"logit"`` (reference pre-processing: dequantise, clamp to ``[alpha, 1 - alpha]``, logit),
            ``"unit"`` (the same without the logit, values in ``[0, 1]``) or ``"logit_squeeze"`` (invertible
            squeeze ``alpha + (1 - 2 alpha)(k + U)/256`` then logit; gives exact pixel-space bits/dim).
        alpha: clamp/squeeze margin.
        pin_memory: pin batches in page-locked memory (for GPU training).
    """

    #: dimension of one model-space vector
    dim: int = 784
    #: shape of one image as (channels, height, width)
    image_shape: tuple[int, int, int] = (1, 28, 28)
    num_classes: int = 10

    def __init__(
        self,
        data_dir: str = "datasets",
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        val_fraction: float = 0.1,
        split_seed: int = 2019,
        train_subset: int | None = None,
        val_subset: int | None = None,
        test_subset: int | None = None,
        use_lmdb: bool = False,
        transform: str = "logit",
        alpha: float = DEFAULT_ALPHA,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        check_transform(transform)
        if batch_size < 1 or (eval_batch_size is not None and eval_batch_size < 1):
            raise ValueError(f"batch sizes must be positive, got {batch_size} and {eval_batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        for name, value in (
            ("train_subset", train_subset),
            ("val_subset", val_subset),
            ("test_subset", test_subset),
        ):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        if not (0.0 <= alpha < 0.5 if transform == "unit" else 0.0 < alpha < 0.5):
            interval = "[0, 0.5)" if transform == "unit" else "(0, 0.5)"
            raise ValueError(f"alpha must lie in {interval} for transform {transform!r}, got {alpha}")
        # No save_hyperparameters(): Lightning refuses to log when the model's and the datamodule's hparams
        # share a key with different values (``alpha``, ``batch_size`` are common names); LightningCLI records
        # the full config anyway.
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size if eval_batch_size is not None else batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.train_subset = train_subset
        self.val_subset = val_subset
        self.test_subset = test_subset
        self.use_lmdb = use_lmdb
        self.transform = transform
        self.alpha = alpha
        self.pin_memory = pin_memory
        self.train_dataset: PreprocessedImageDataset | None = None
        self.val_dataset: PreprocessedImageDataset | None = None
        self.test_dataset: PreprocessedImageDataset | None = None

    # -- data preparation ----------------------------------------------------------------------------------

    def lmdb_path(self, train: bool) -> Path:
        """Directory of the LMDB cache of MNIST-train (``train=True``) or MNIST-test."""
        return Path(self.data_dir) / "mnist_lmdb" / ("train" if train else "test")

    def _lmdb_complete(self, train: bool) -> bool:
        try:
            return bool(lmdb_cache_info(self.lmdb_path(train))["complete"])
        except (FileNotFoundError, ValueError):
            return False

    def _build_lmdb(self, train: bool, sources: tuple[str, ...]) -> None:
        images, labels = load_mnist(self.data_dir, train, sources=sources)
        build_lmdb_cache(images, labels, self.lmdb_path(train))

    def prepare_data(self) -> None:
        """Make sure MNIST can be loaded (downloading it as a last resort) and build the LMDB cache if asked.

        Lightning calls this on one process per node only, so the download and the cache build happen once.
        """
        for train in (True, False):
            if self.use_lmdb:
                if not self._lmdb_complete(train):
                    self._build_lmdb(train, ("torchvision", "pureml", "download"))
            else:
                load_mnist(self.data_dir, train)

    def _base(self, train: bool) -> Dataset:
        if self.use_lmdb:
            if not self._lmdb_complete(train):  # setup() without prepare_data()
                self._build_lmdb(train, _LOCAL_SOURCES)
            return LMDBImageDataset(self.lmdb_path(train))
        images, labels = load_mnist(self.data_dir, train, sources=_LOCAL_SOURCES)
        return ArrayImageDataset(images, labels)

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets of ``stage`` (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``, None))."""
        if stage in (None, "fit", "validate") and self.train_dataset is None:
            base = self._base(train=True)
            train_idx, val_idx = split_indices(len(base), self.val_fraction, self.split_seed)
            if self.train_subset is not None:
                train_idx = train_idx[: self.train_subset]
            if self.val_subset is not None:
                val_idx = val_idx[: self.val_subset]
            self.train_dataset = PreprocessedImageDataset(
                base, train_idx, self.transform, self.alpha, _TRAIN_NOISE_SEED, per_epoch=True
            )
            self.val_dataset = PreprocessedImageDataset(
                base, val_idx, self.transform, self.alpha, _VAL_NOISE_SEED
            )
        if stage in (None, "test", "predict") and self.test_dataset is None:
            base = self._base(train=False)
            test_idx = np.arange(len(base))
            if self.test_subset is not None:
                test_idx = test_idx[: self.test_subset]
            self.test_dataset = PreprocessedImageDataset(
                base, test_idx, self.transform, self.alpha, _TEST_NOISE_SEED
            )

    # -- loaders -------------------------------------------------------------------------------------------

    def _loader(self, dataset: Dataset | None, name: str, batch_size: int, train: bool) -> DataLoader:
        if dataset is None:
            stage = "fit" if name in ("train", "val") else "test"
            raise RuntimeError(f"the {name} dataset is not built; call setup({stage!r}) first")
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=EpochShuffleSampler(len(dataset), self.split_seed) if train else None,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
        )

    def set_epoch(self, epoch: int) -> None:
        """Select the training epoch's dequantisation noise (called by the LightningModule each epoch)."""
        if self.train_dataset is not None:
            self.train_dataset.set_epoch(epoch)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches ``(x [B, 784], labels [B])``; the last incomplete batch is dropped."""
        if self.train_dataset is not None and len(self.train_dataset) < self.batch_size:
            raise ValueError(
                f"the training set has {len(self.train_dataset)} items, fewer than "
                f"batch_size={self.batch_size}, so drop_last would leave no batch; lower batch_size or raise "
                "train_subset"
            )
        return self._loader(self.train_dataset, "train", self.batch_size, train=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order with fixed dequantisation noise."""
        return self._loader(self.val_dataset, "val", self.eval_batch_size, train=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches in a fixed order with fixed dequantisation noise."""
        return self._loader(self.test_dataset, "test", self.eval_batch_size, train=False)

    def predict_dataloader(self) -> DataLoader:
        """Same as :meth:`test_dataloader`."""
        return self.test_dataloader()

    # -- model space <-> images ----------------------------------------------------------------------------

    def to_images(self, x: torch.Tensor) -> torch.Tensor:
        """Map model-space vectors ``[B, 784]`` to images ``[B, 1, 28, 28]`` in ``[0, 1]`` (sample grids)."""
        return to_unit(x, self.transform, self.alpha).reshape(-1, *self.image_shape)

    def bits_per_dim(self, log_prob: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Pixel-space bits/dim ``[B]`` of model-space samples ``x`` of model log-density ``log_prob`` (nats).

        Uses :func:`deqscore.data.transforms.bits_per_dim` with the logit Jacobian (and the squeeze Jacobian
        for ``"logit_squeeze"``); for ``"unit"`` ``log_prob`` is already a density on ``[0, 1]^D``. Exact for
        ``"logit_squeeze"``; approximate for the reference clamp pipelines (``"logit"``, ``"unit"``).
        """
        log_prob = log_prob.double()
        if self.transform == "unit":
            dims = x[0].numel()
            return -(log_prob - dims * math.log(256)) / (dims * math.log(2.0))
        alpha = self.alpha if self.transform == "logit_squeeze" else 0.0
        return bits_per_dim(log_prob, inverse_logit(x.double()), alpha=alpha)
