"""Data: 8-bit image DataModules (one module per dataset, on the generic :class:`ImageDataModule`), the
dequantisation/logit pre-processing and its :class:`ImageCodec`, an LMDB image cache and the MNIST loaders; and
the UCI density-estimation data sets of the DKEF experiments (:class:`UCIDataModule`).

Layout: :mod:`.base` (``ImageDataModule``), :mod:`.datasets` (split, datasets, sampler), :mod:`.transforms`
(pre-processing, bits/dim, ``ImageCodec``), :mod:`.lmdb_cache`, :mod:`.zarr` (zarr zip reader),
:mod:`.errors` and one module per dataset (:mod:`.mnist`, :mod:`.cifar`, :mod:`.celeba`, :mod:`.uci`).
"""

from deqscore.data.base import ImageDataModule
from deqscore.data.celeba import CelebADataModule
from deqscore.data.cifar import CIFAR10DataModule
from deqscore.data.datasets import ArrayImageDataset, EpochShuffleSampler, PreprocessedImageDataset, split_indices
from deqscore.data.errors import CorruptDataError, DataNotFoundError
from deqscore.data.folder import ImageFolderDataModule
from deqscore.data.lmdb_build import build_lmdb_cache
from deqscore.data.lmdb_cache import LMDBImageDataset, lmdb_cache_info
from deqscore.data.mnist import MNISTDataModule, clear_mnist_cache, find_pureml_mnist, load_mnist
from deqscore.data.protocol import DensityData, EpochData, ImageData, PointData, ScoreData
from deqscore.data.transforms import (
    DEFAULT_ALPHA,
    TRANSFORMS,
    ImageCodec,
    bits_per_dim,
    check_transform,
    dequantize,
    dequantize_squeeze,
    inverse_logit,
    inverse_squeeze,
    logit_log_det,
    logit_transform,
    preprocess,
    to_unit,
)
from deqscore.data.uci import UCIDataModule
from deqscore.data.zarr import read_zarr_zip_array

__all__ = [
    "ImageFolderDataModule",
    "DensityData",
    "EpochData",
    "ImageData",
    "PointData",
    "ScoreData",
    "DEFAULT_ALPHA",
    "TRANSFORMS",
    "ArrayImageDataset",
    "CIFAR10DataModule",
    "CelebADataModule",
    "CorruptDataError",
    "DataNotFoundError",
    "EpochShuffleSampler",
    "ImageCodec",
    "ImageDataModule",
    "LMDBImageDataset",
    "MNISTDataModule",
    "PreprocessedImageDataset",
    "UCIDataModule",
    "bits_per_dim",
    "build_lmdb_cache",
    "check_transform",
    "clear_mnist_cache",
    "dequantize",
    "dequantize_squeeze",
    "find_pureml_mnist",
    "inverse_logit",
    "inverse_squeeze",
    "lmdb_cache_info",
    "load_mnist",
    "logit_log_det",
    "logit_transform",
    "preprocess",
    "read_zarr_zip_array",
    "split_indices",
    "to_unit",
]
