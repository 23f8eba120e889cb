"""``CIFAR10DataModule``: CIFAR-10 (32x32 RGB, 50,000 train / 10,000 test) in torchvision's on-disk layout.

Files: ``<data_dir>/cifar-10-batches-py/{data_batch_1, ..., data_batch_5, test_batch}`` (Python pickles with
``b"data"`` uint8 ``[N, 3072]`` in channel-major order and ``b"labels"``), as torchvision extracts them; an archive
``<data_dir>/cifar-10-python.tar.gz`` is extracted when the folder is missing. :meth:`prepare_data` downloads
through ``torchvision.datasets.CIFAR10`` as a last resort; offline the error names the files and where to put them.
Each file's MD5 is compared with torchvision's list: a mismatch warns (another parseable copy may be legitimate), a
file that does not parse raises :class:`~deqscore.data.errors.CorruptDataError` naming it.

Config (the NCSN convention: images in [0, 1], random horizontal flips in training)::

    data:
      class_path: deqscore.data.CIFAR10DataModule
      init_args: {data_dir: datasets, batch_size: 128, transform: pixels, random_flip: true}
"""

from __future__ import annotations

import hashlib
import pickle
import tarfile
import warnings
from pathlib import Path

import numpy as np

from deqscore.data.base import ImageDataModule
from deqscore.data.errors import CorruptDataError, DataNotFoundError

FOLDER = "cifar-10-batches-py"
ARCHIVE = "cifar-10-python.tar.gz"
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)


def _expected_md5() -> dict[str, str]:
    """torchvision's MD5 of every batch file."""
    from torchvision.datasets import CIFAR10

    return dict(CIFAR10.train_list + CIFAR10.test_list)


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch as ``(uint8 images [N, 3, 32, 32], int64 labels [N])``."""
    expected = _expected_md5().get(path.name)
    if expected is not None and _md5(path) != expected:
        warnings.warn(f"{path}: MD5 differs from the CIFAR-10 original ({expected}); using it as long as it parses",
                      RuntimeWarning, stacklevel=2)
    try:
        with open(path, "rb") as fh:
            batch = pickle.load(fh, encoding="bytes")  # the data set's own format: Python pickles
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except Exception as err:  # truncated, foreign or tampered files
        raise CorruptDataError(f"{path} is not a CIFAR-10 batch file ({type(err).__name__}: {err})") from err
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise CorruptDataError(f"{path}: data {data.shape} and {len(labels)} labels, expected [N, 3072] and N labels")
    return data.reshape(-1, 3, 32, 32), labels


def _extract(archive: Path, root: Path) -> None:
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(root, filter="data")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise CorruptDataError(f"{archive} cannot be extracted ({type(err).__name__}: {err})") from err


def load_cifar10(root: str | Path, train: bool, download: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10's train or test split from ``root`` (see the module docstring)."""
    root = Path(root)
    folder, names = root / FOLDER, TRAIN_FILES if train else TEST_FILES
    missing = [n for n in names if not (folder / n).is_file()]
    if missing and (root / ARCHIVE).is_file():
        _extract(root / ARCHIVE, root)
    elif missing and download:
        from torchvision.datasets import CIFAR10

        try:
            CIFAR10(str(root), train=train, download=True)
        except Exception as err:  # offline: say what to put where
            warnings.warn(f"CIFAR-10 download failed: {err}", RuntimeWarning, stacklevel=2)
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise DataNotFoundError(
            f"CIFAR-10 {'train' if train else 'test'} files {', '.join(missing)} are not in {folder}; put "
            f"{ARCHIVE} (from {URL}) in {root}, or its extracted folder {FOLDER}/ there"
        )
    parts = [read_batch(folder / n) for n in names]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


class CIFAR10DataModule(ImageDataModule):
    """CIFAR-10 as flattened 3072-d vectors; the options are those of :class:`~deqscore.data.base.ImageDataModule`
    (use ``transform: pixels`` for score networks, ``random_flip: true`` as NCSN)."""

    name = "cifar10"
    image_shape = (3, 32, 32)
    num_classes = 10

    def load_arrays(self, train: bool, *, download: bool) -> tuple[np.ndarray, np.ndarray]:
        return load_cifar10(self.data_dir, train, download=download)
