"""What a model family may ask of its data module: one typed protocol per capability.

Every data module is a LightningDataModule with train/val/test loaders and :class:`ScoreData`'s ``dim`` (linked to
the network's ``dim`` by the CLI). Beyond that a family asks only for the capabilities it needs, and checks for them
with ``isinstance`` (the protocols are runtime-checkable), so a new data module serves every family whose needs it
meets:

* :class:`EpochData`: epoch-dependent randomness (dequantisation noise, shuffling) that follows the epoch;
* :class:`ImageData`: images, their transform to model space and back (``codec``), the data folder, and the raw
  8-bit images of a split, the reference set of FID and KID;
* :class:`DensityData`: bits/dim of a log-density of the transformed data, in the 8-bit pixels' units;
* :class:`PointData`: data held as one tensor per split (UCI tables), with random training subsets, and for
  synthetic data the true score and log-density.

>>> from deqscore.data import MNISTDataModule, UCIDataModule
>>> isinstance(MNISTDataModule(), ImageData), isinstance(MNISTDataModule(), PointData)
(True, False)
>>> isinstance(UCIDataModule(), PointData), isinstance(UCIDataModule(), ImageData)
(True, False)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .transforms import ImageCodec


@runtime_checkable
class ScoreData(Protocol):
    """Every data module: values per sample (the network's ``dim``)."""

    @property
    def dim(self) -> int: ...


@runtime_checkable
class EpochData(Protocol):
    """Randomness that changes with the epoch (set before each training epoch, also after a resume)."""

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class ImageData(ScoreData, Protocol):
    """Images: the codec between 8-bit images and model space, where they live, and the FID reference set."""

    name: str
    data_dir: str

    @property
    def codec(self) -> ImageCodec: ...

    @property
    def image_shape(self) -> tuple[int, int, int]: ...

    def raw_images(self, train: bool = True) -> np.ndarray: ...


@runtime_checkable
class DensityData(Protocol):
    """Bits/dim of the 8-bit data from a log-density of the transformed data (transform Jacobian included)."""

    @property
    def bits_per_dim_exact(self) -> bool: ...

    def bits_per_dim(self, log_prob: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class PointData(ScoreData, Protocol):
    """Data held as one tensor per split, with random training subsets and the evaluation batch size."""

    train_data: torch.Tensor
    val_data: torch.Tensor
    eval_batch_size: int

    def train_subset(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor: ...


__all__ = ["DensityData", "EpochData", "ImageData", "PointData", "ScoreData"]
