"""``CIFAR10DataModule``: CIFAR-10 (32x32 RGB, 50,000 train / 10,000 test) in torchvision's on-disk layout.

Files: ``<data_dir>/cifar-10-batches-py/{data_batch_1, ..., data_batch_5, test_batch}`` (Python pickles with
``b"data"`` uint8 ``[N, 3072]``, each row the red, green then blue 32x32 plane in row-major order, and
``b"labels"``), as torchvision extracts them; an archive ``<data_dir>/cifar-10-python.tar.gz`` is extracted when a
file is missing. :meth:`prepare_data` downloads through ``torchvision.datasets.CIFAR10`` as a last resort (never
:meth:`setup`); offline the error names the files, the archive, its URL and the folder to put them in.

Each file's MD5 is compared with torchvision's list: a mismatch warns (another parseable copy may be legitimate),
a file that does not parse raises :class:`~deqscore.data.errors.CorruptDataError` naming it. The pickles are read
by a restricted unpickler that builds numpy arrays and plain containers only (a pickle may otherwise run any code
while loading, and a file whose MD5 differs is still read).

Config (the NCSN convention: images in [0, 1], random horizontal flips in training)::

    data:
      class_path: deqscore.data.CIFAR10DataModule
      init_args: {data_dir: datasets, batch_size: 128, transform: pixels, random_flip: true}
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tarfile
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from deqscore.data.base import ImageDataModule
from deqscore.data.errors import CorruptDataError, DataNotFoundError
from deqscore.files import staged

__all__ = ["CIFAR10DataModule", "load_cifar10", "read_batch"]

FOLDER = "cifar-10-batches-py"
ARCHIVE = "cifar-10-python.tar.gz"
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10

# The globals a batch file may name: numpy's array and scalar reconstructors under numpy 1 (``numpy.core``, the
# original files) and numpy 2 (``numpy._core``) module names, and ``_codecs.encode`` (bytes in protocol-2 pickles).
_ALLOWED_GLOBALS = {
    (module, name)
    for core in ("numpy.core", "numpy._core")
    for module, name in ((f"{core}.multiarray", "_reconstruct"), (f"{core}.multiarray", "scalar"),
                         (f"{core}.numeric", "_frombuffer"))
} | {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and built-in containers only; any other global is refused before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"the pickle asks for {module}.{name}, which a CIFAR-10 batch never holds")
        return super().find_class(module, name)


def _expected_md5() -> dict[str, str]:
    """torchvision's MD5 of every batch file, by file name."""
    from torchvision.datasets import CIFAR10

    return dict(CIFAR10.train_list + CIFAR10.test_list)


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_md5(path: Path) -> None:
    expected = _expected_md5().get(path.name)
    found = _md5(path)
    if expected is not None and found != expected:
        # the message starts with a fixed phrase, so that warning filters (which match its start) can name it
        warnings.warn(f"MD5 differs from the CIFAR-10 original: {path} has {found}, torchvision lists {expected}; "
                      "using it as long as it parses", RuntimeWarning, stacklevel=3)


def _integers(path: Path, values: Any, what: str, high: int) -> np.ndarray:
    """``values`` as an integer array in ``[0, high]``, or CorruptDataError (no silent wrap-around to uint8)."""
    array = np.asarray(values)
    if array.size and (array.dtype.kind not in "iu" or array.min() < 0 or array.max() > high):
        raise CorruptDataError(f"{path}: {what} must be integers in 0..{high}, got {array.dtype} values")
    return array


def read_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch as ``(uint8 images [N, 3, 32, 32], int64 labels [N])``; warns on an MD5 mismatch."""
    path = Path(path)
    _check_md5(path)
    try:
        with open(path, "rb") as fh:
            batch = _BatchUnpickler(fh, encoding="bytes").load()  # bytes keys, as the files were written by Python 2
        data, labels = batch[b"data"], batch[b"labels"]
    except Exception as err:  # truncated, foreign or tampered files
        raise CorruptDataError(f"{path} is not a CIFAR-10 batch file ({type(err).__name__}: {err})") from err
    data = _integers(path, data, "pixels", 255).astype(np.uint8)
    labels = _integers(path, labels, "labels", NUM_CLASSES - 1).astype(np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (len(data),):
        raise CorruptDataError(f"{path}: data {data.shape} and labels {labels.shape}, expected [N, 3072] and [N]")
    return data.reshape(-1, *IMAGE_SHAPE), labels


def _extract(archive: Path, root: Path) -> None:
    """Extract into a scratch folder beside the data, then put the archive's files in place together
    (:func:`~deqscore.files.staged`): a damaged or interrupted archive leaves no truncated batch behind."""
    try:
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{FOLDER}.") as scratch:
            with tarfile.open(archive, "r:gz") as tar:
                tar.extractall(scratch, filter="data")  # "data": no absolute paths, links out of root or devices
            files = sorted(p.name for p in (Path(scratch) / FOLDER).glob("*") if p.is_file())
            (root / FOLDER).mkdir(exist_ok=True)
            with staged([root / FOLDER / name for name in files]) as temps:
                for name, temp in zip(files, temps, strict=True):
                    os.replace(Path(scratch) / FOLDER / name, temp)
    except (tarfile.TarError, OSError, EOFError) as err:
        raise CorruptDataError(f"{archive} cannot be extracted ({type(err).__name__}: {err})") from err


def _download(root: Path, train: bool) -> str:
    """Fetch and extract the archive through torchvision; returns why it failed ('' when it did not)."""
    from torchvision.datasets import CIFAR10

    try:
        CIFAR10(str(root), train=train, download=True)
    except Exception as err:  # offline, a proxy, a full disk: reported in the one error below
        return f"{type(err).__name__}: {err}"
    return ""


def load_cifar10(root: str | Path, train: bool, download: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10's train or test split from ``root`` as ``(uint8 [N, 3, 32, 32], int64 labels [N])`` (see the
    module docstring): the folder, else the archive in ``root``, else (``download`` only) torchvision."""
    root = Path(root)
    folder, names = root / FOLDER, TRAIN_FILES if train else TEST_FILES
    missing, failure = [n for n in names if not (folder / n).is_file()], ""
    if missing and (root / ARCHIVE).is_file():
        _extract(root / ARCHIVE, root)
    elif missing and download:
        failure = _download(root, train)
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        tried = f" (its download failed: {failure})" if failure else ""
        raise DataNotFoundError(
            f"CIFAR-10 {'train' if train else 'test'} file(s) {', '.join(missing)} not found in "
            f"{folder.resolve()}{tried}; put {ARCHIVE} (from {URL}) in {root.resolve()}, or the files it holds in "
            f"{folder.resolve()}"
        )
    parts = [read_batch(folder / n) for n in names]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


class CIFAR10DataModule(ImageDataModule):
    """CIFAR-10 as flattened 3072-d vectors (channel-major: the red plane, then green, then blue).

    The options are those of :class:`~deqscore.data.base.ImageDataModule`: use ``transform: pixels`` for score
    networks and ``random_flip: true`` as NCSN; ``val_fraction`` of the 50,000 training images is held out.
    """

    name = "cifar10"
    image_shape = IMAGE_SHAPE
    num_classes = NUM_CLASSES

    def load_arrays(self, train: bool, *, download: bool) -> tuple[np.ndarray, np.ndarray]:
        """The train (``data_batch_1..5``) or test (``test_batch``) split, see :func:`load_cifar10`."""
        return load_cifar10(self.data_dir, train, download=download)
