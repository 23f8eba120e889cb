"""``ImageDataModule``: everything an 8-bit image DataModule needs that does not depend on the dataset.

The dataset's official train split is split ``1 - val_fraction`` / ``val_fraction`` into train / val with a
fixed numpy seed (2019 by default, as the reference code: ``np.random.seed(2019); np.random.shuffle(indices)``);
its official test split is the test set. Items are dequantised (except under ``transform="pixels"``),
pre-processed (:mod:`deqscore.data.transforms`) and flattened to ``dim``-vectors. Train items get fresh
dequantisation noise every epoch, a fresh shuffle and, with ``random_flip``, a fresh horizontal-flip coin, all
drawn from generators seeded by (epoch, item), so a resumed run sees exactly the data an uninterrupted one would
(whatever the workers or processes); val/test items get noise from a generator seeded by the item's index and are
never flipped, so evaluation metrics are reproducible.

A dataset is added by subclassing :class:`ImageDataModule` (see its docstring); :class:`deqscore.data.MNISTDataModule`
is the reference subclass. Config use (LightningCLI)::

    data:
      class_path: deqscore.data.MNISTDataModule
      init_args: {batch_size: 128, transform: logit_squeeze, use_lmdb: false}
"""

from __future__ import annotations

import abc
import math
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from deqscore.data.datasets import (
    TEST_NOISE_SEED,
    TRAIN_NOISE_SEED,
    VAL_NOISE_SEED,
    ArrayImageDataset,
    PreprocessedImageDataset,
    epoch_loader,
    split_indices,
)
from deqscore.data.lmdb_build import build_lmdb_cache
from deqscore.data.lmdb_cache import LMDBImageDataset, lmdb_cache_info
from deqscore.data.transforms import DEFAULT_ALPHA, ImageCodec
from deqscore.errors import ConfigError

__all__ = ["ImageDataModule"]


class ImageDataModule(pl.LightningDataModule, abc.ABC):
    """Dequantised 8-bit images as flattened ``dim``-vectors for density models (docs/method.md section 4.1).

    **Adding a dataset** (the extension point). Subclass and supply:

    * class attributes ``name`` (short and lower case; the LMDB cache lives in
      ``<data_dir>/<name>_lmdb/{train,test}``), ``image_shape`` (``(channels, height, width)``) and
      ``num_classes``; ``dim`` (values per model-space vector) is derived from ``image_shape``;
    * :meth:`load_arrays` ``(train, *, download) -> (images, labels)``: the official train (``train=True``) or
      test split as uint8 images ``[N, ...]`` with ``dim`` values each and integer labels ``[N]``;
    * :meth:`prepare_data` only if the data need more than ``load_arrays(train, download=True)`` (the default,
      which also builds the LMDB caches when ``use_lmdb``).

    Keep the constructor (or extend it with keyword arguments) so that LightningCLI sees every option::

        class TinyDataModule(ImageDataModule):
            name, image_shape, num_classes = "tiny", (1, 4, 4), 2

            def load_arrays(self, train, *, download):
                return load_tiny(self.data_dir, train, allow_download=download)

    Args:
        data_dir: data root: the dataset's files, downloads and the LMDB cache go here.
        batch_size: training batch size.
        eval_batch_size: val/test batch size (default ``batch_size``).
        num_workers: DataLoader workers (persistent when > 0).
        val_fraction: fraction of the train split held out for validation.
        split_seed: numpy seed of the train/val split (2019 as the reference code) and of the shuffles.
        train_subset: keep only the first n training items after the split (quick demos/tests).
        val_subset: same for validation.
        test_subset: same for the test set.
        use_lmdb: read images from an LMDB cache built once under ``<data_dir>/<name>_lmdb/``.
        transform: ``"logit_squeeze"`` (invertible squeeze ``alpha + (1 - 2 alpha)(k + U)/256`` then logit;
            gives exact pixel-space bits/dim), ``"logit"`` (reference pre-processing: dequantise, clamp to
            ``[alpha, 1 - alpha]``, logit), ``"unit"`` (the reference clamp without the logit, values in
            ``[0, 1]``) or ``"pixels"`` (``k/255`` exactly, no noise: the convention of score networks on images).
        alpha: clamp/squeeze margin.
        pin_memory: pin batches in page-locked memory (for GPU training).
        random_flip: flip training items horizontally with probability 1/2 (val/test never), the coin seeded per
            epoch and item like the dequantisation noise, so a resumed run sees the same flips.
    """

    #: short lower-case name of the dataset (LMDB cache folder ``<data_dir>/<name>_lmdb``)
    name: ClassVar[str]
    #: shape of one image as (channels, height, width)
    image_shape: ClassVar[tuple[int, ...]]
    num_classes: ClassVar[int]
    #: dimension of one model-space vector, ``prod(image_shape)`` (set for each subclass)
    dim: ClassVar[int]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # derived once per class, so that ``SomeDataModule.dim`` works before any instance exists
        if "image_shape" in cls.__dict__:
            cls.dim = math.prod(cls.image_shape)

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
        transform: Literal["logit", "unit", "logit_squeeze", "pixels"] = "logit_squeeze",
        alpha: float = DEFAULT_ALPHA,
        pin_memory: bool = False,
        random_flip: bool = False,
    ) -> None:
        super().__init__()
        self._check_class_attributes()
        ImageCodec(transform, alpha, self.image_shape)  # validates transform and alpha
        _check_options(batch_size, eval_batch_size, num_workers, val_fraction, train_subset, val_subset, test_subset)
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
        self.random_flip = random_flip
        self.train_dataset: PreprocessedImageDataset | None = None
        self.val_dataset: PreprocessedImageDataset | None = None
        self.test_dataset: PreprocessedImageDataset | None = None

    @classmethod
    def _check_class_attributes(cls) -> None:
        # LightningDataModule itself defines ``name = None``: a subclass that forgets it would cache in "None_lmdb"
        missing = [a for a in ("name", "image_shape", "num_classes") if getattr(cls, a, None) in (None, "", ())]
        if missing:
            raise TypeError(f"{cls.__name__} must set the class attribute(s) {', '.join(missing)}; see ImageDataModule")

    # -- the dataset-specific part -------------------------------------------------------------------------

    @abc.abstractmethod
    def load_arrays(self, train: bool, *, download: bool) -> tuple[np.ndarray, np.ndarray]:
        """The official train (``train=True``) or test split as ``(uint8 images [N, ...], int labels [N])``.

        ``download=False`` is used by :meth:`setup` (every process) and must never touch the network;
        ``download=True`` is used by :meth:`prepare_data` (one process per node) and may fetch the data.
        """

    def prepare_data(self) -> None:
        """Make sure both splits can be loaded (downloading as a last resort) and build the LMDB caches if asked.

        Lightning calls this on one process per node only, so downloads and cache builds happen once.
        """
        for train in (True, False):
            if not self.use_lmdb:
                self._arrays(train, download=True)
            elif not self._lmdb_complete(train, verify=True):  # once per run: a damaged cache is rebuilt
                self._build_lmdb(train, download=True)

    def _arrays(self, train: bool, download: bool) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`load_arrays`, checked against the class attributes (a wrong loader fails here, clearly)."""
        images, labels = self.load_arrays(train, download=download)
        per_image = math.prod(images.shape[1:]) if images.ndim > 1 else 0
        if images.dtype != np.uint8 or per_image != self.dim:
            raise ValueError(
                f"{type(self).__name__}.load_arrays must return uint8 images of {self.dim} values each "
                f"(image_shape {self.image_shape}), got {images.dtype} {images.shape}"
            )
        return images, labels

    def raw_images(self, train: bool = True) -> np.ndarray:
        """The official train (or test) split as uint8 images ``[N, *image_shape]``, before any pre-processing
        (FID reference statistics are taken on these). Never downloads."""
        images, _ = self._arrays(train, download=False)
        return images.reshape(len(images), *self.image_shape)

    # -- LMDB cache ----------------------------------------------------------------------------------------

    def lmdb_path(self, train: bool) -> Path:
        """Directory of the LMDB cache of the train (``train=True``) or test split."""
        return Path(self.data_dir) / f"{self.name}_lmdb" / ("train" if train else "test")

    def _lmdb_complete(self, train: bool, verify: bool = False) -> bool:
        """Whether the cache is usable; ``verify`` also checks every item's checksum (about 0.4 s for MNIST)."""
        try:
            return bool(lmdb_cache_info(self.lmdb_path(train), verify=verify)["complete"])
        except (FileNotFoundError, ValueError):
            return False

    def _build_lmdb(self, train: bool, download: bool) -> None:
        build_lmdb_cache(*self._arrays(train, download), self.lmdb_path(train))

    # -- datasets ------------------------------------------------------------------------------------------

    def _base(self, train: bool) -> Dataset:
        if self.use_lmdb:
            if not self._lmdb_complete(train):  # setup() without prepare_data()
                self._build_lmdb(train, download=False)
            return LMDBImageDataset(self.lmdb_path(train))
        return ArrayImageDataset(*self._arrays(train, download=False))

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets of ``stage`` (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``, None))."""
        if stage in (None, "fit", "validate") and self.train_dataset is None:
            base = self._base(train=True)
            train_idx, val_idx = split_indices(len(base), self.val_fraction, self.split_seed)
            self.train_dataset = self._preprocessed(base, train_idx[: self.train_subset], TRAIN_NOISE_SEED, True,
                                                    flip=self.random_flip)
            self.val_dataset = self._preprocessed(base, val_idx[: self.val_subset], VAL_NOISE_SEED, False)
        if stage in (None, "test", "predict") and self.test_dataset is None:
            base = self._base(train=False)
            test_idx = np.arange(len(base))[: self.test_subset]
            self.test_dataset = self._preprocessed(base, test_idx, TEST_NOISE_SEED, False)

    def _preprocessed(
        self, base: Dataset, indices: np.ndarray, noise_seed: int, per_epoch: bool, flip: bool = False
    ) -> PreprocessedImageDataset:
        # per_epoch: training noise changes with the epoch; val/test noise is fixed per item
        return PreprocessedImageDataset(base, indices, self.transform, self.alpha, noise_seed, per_epoch=per_epoch,
                                        flip_shape=self.image_shape if flip else None)

    def set_epoch(self, epoch: int) -> None:
        """Select the training epoch's dequantisation noise and flips (called by the LightningModule each epoch)."""
        if self.train_dataset is not None:
            self.train_dataset.set_epoch(epoch)

    # -- loaders -------------------------------------------------------------------------------------------

    def _loader(self, dataset: Dataset | None, name: str, batch_size: int, train: bool) -> DataLoader:
        if dataset is None:
            stage = "fit" if name in ("train", "val") else "test"
            raise RuntimeError(f"the {name} dataset is not built; call setup({stage!r}) first")
        return epoch_loader(dataset, batch_size, train, self.split_seed, self.num_workers, self.pin_memory)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches ``(x [B, dim], labels [B])``; the last incomplete batch is dropped."""
        if self.train_dataset is not None and len(self.train_dataset) < self.batch_size:
            raise ConfigError(  # a usage mistake (subsets and batch size set apart): one line, no traceback
                f"data.batch_size: {self.batch_size} is more than the {len(self.train_dataset)} training items, "
                "and the last incomplete batch is dropped, so no batch is left; lower data.batch_size or raise "
                "data.train_subset"
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

    @property
    def codec(self) -> ImageCodec:
        """The map between this module's model space and images (plain values; store it with a model)."""
        return ImageCodec(self.transform, self.alpha, self.image_shape)

    @property
    def bits_per_dim_exact(self) -> bool:
        """Whether :meth:`bits_per_dim` is exact (``transform="logit_squeeze"``) rather than approximate."""
        return self.codec.exact_bits_per_dim

    def to_images(self, x: torch.Tensor) -> torch.Tensor:
        """Map model-space vectors ``[B, dim]`` to images ``[B, *image_shape]`` in ``[0, 1]`` (sample grids)."""
        return self.codec.to_images(x)

    def bits_per_dim(self, log_prob: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Pixel-space bits/dim ``[B]`` of model-space samples ``x`` of model log-density ``log_prob`` (nats).

        See :meth:`deqscore.data.transforms.ImageCodec.bits_per_dim`: exact for ``"logit_squeeze"``,
        approximate for the reference clamp pipelines (``"logit"``, ``"unit"``), a ``ValueError`` for ``"pixels"``.
        """
        return self.codec.bits_per_dim(log_prob, x)


def _check_options(
    batch_size: int,
    eval_batch_size: int | None,
    num_workers: int,
    val_fraction: float,
    train_subset: int | None,
    val_subset: int | None,
    test_subset: int | None,
) -> None:
    for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be positive, got {value}", key=name)
    if num_workers < 0:
        raise ConfigError(f"num_workers must be >= 0, got {num_workers}", key="num_workers")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must lie in [0, 1), got {val_fraction}", key="val_fraction")
    for name, value in (("train_subset", train_subset), ("val_subset", val_subset), ("test_subset", test_subset)):
        if value is not None and value < 0:
            raise ConfigError(f"{name} must be >= 0 or None, got {value}", key=name)
