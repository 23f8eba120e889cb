"""Data: MNIST loading, dequantisation/logit pre-processing, an LMDB image cache and the MNIST DataModule."""

from deqscore.data.datamodule import (
    ArrayImageDataset,
    MNISTDataModule,
    PreprocessedImageDataset,
    split_indices,
)
from deqscore.data.lmdb_cache import LMDBImageDataset, build_lmdb_cache, lmdb_cache_info
from deqscore.data.mnist import (
    CorruptDataError,
    clear_mnist_cache,
    find_pureml_mnist,
    load_mnist,
    read_zarr_zip_array,
)
from deqscore.data.transforms import (
    DEFAULT_ALPHA,
    TRANSFORMS,
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

__all__ = [
    "DEFAULT_ALPHA",
    "TRANSFORMS",
    "ArrayImageDataset",
    "CorruptDataError",
    "LMDBImageDataset",
    "MNISTDataModule",
    "PreprocessedImageDataset",
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
