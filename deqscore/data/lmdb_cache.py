"""An LMDB cache of (image, label) pairs that any image DataModule can use.

Layout of a cache (an LMDB directory): key ``b"<index>"`` (ascii) -> raw image bytes followed by the label
as a little-endian int64; meta keys ``__len__``, ``__shape__`` (per-image shape, JSON), ``__dtype__`` (numpy
dtype string), ``__sha1__`` (of images, labels, shape and dtype) and ``__complete__``, written last, in a
separate transaction. A cache is built in a temporary directory and moved into place, so a complete-looking
cache was written in full.

>>> import numpy as np, tempfile
>>> images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
>>> path = build_lmdb_cache(images, np.array([3, 7]), tempfile.mkdtemp() + "/cache")
>>> ds = LMDBImageDataset(path)
>>> len(ds), ds[1][1], bool((ds[1][0].numpy() == images[1]).all())
(2, 7, True)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["LMDBImageDataset", "build_lmdb_cache", "lmdb_cache_info"]

_LEN = b"__len__"
_SHAPE = b"__shape__"
_DTYPE = b"__dtype__"
_SHA1 = b"__sha1__"
_COMPLETE = b"__complete__"
_FORMAT = b"__format__"
_FORMAT_VERSION = b"deqscore-lmdb-1"
_LABEL_DTYPE = np.dtype("<i8")
_WRITE_BATCH = 4096

# Read-only environments opened by this module, keyed by (pid, real path). LMDB forbids opening the same
# environment twice in one process and using an environment inherited through fork(); keying by pid gives each
# DataLoader worker its own. py-lmdb (>= 2) also remembers the files of every open environment and, after a
# fork, refuses to open them again in the child while the inherited handle is open: a child therefore closes
# the handles it inherited from this registry first. They are read-only and lock-free (no reader table), so
# closing the child's copy releases only the child's mapping and file descriptors, never the parent's.
_ENVS: dict[tuple[int, str], lmdb.Environment] = {}


def _key(path: Path) -> tuple[int, str]:
    return os.getpid(), os.path.realpath(path)


def _open_readonly(path: Path) -> lmdb.Environment:
    return lmdb.open(
        str(path), readonly=True, lock=False, readahead=False, meminit=False, subdir=True, max_readers=512
    )


def _drop_inherited(realpath: str) -> None:
    """Close this process's copies of the environments of ``realpath`` that a parent opened before forking."""
    pid = os.getpid()
    for key in [k for k in _ENVS if k[1] == realpath and k[0] != pid]:
        _ENVS.pop(key).close()


def _shared_env(path: Path) -> lmdb.Environment:
    """The read-only environment of ``path`` for this process, opened on first use."""
    key = _key(path)
    env = _ENVS.get(key)
    if env is None:
        _drop_inherited(key[1])
        env = _ENVS[key] = _open_readonly(path)
    return env


def _close_shared_env(path: Path) -> None:
    env = _ENVS.pop(_key(path), None)
    if env is not None:
        env.close()


def _missing_message(path: Path) -> str:
    return (
        f"no LMDB cache at {path} (expected a directory holding data.mdb); build it with build_lmdb_cache()"
    )


def lmdb_cache_info(path: str | Path) -> dict[str, Any]:
    """Read the meta keys of the cache at ``path``.

    Returns:
        ``{"len": int, "shape": tuple, "dtype": np.dtype, "sha1": str, "complete": bool}``; ``complete`` is
        False for a cache whose build was interrupted.

    Raises:
        FileNotFoundError: ``path`` holds no LMDB environment.
        ValueError: ``path`` is an LMDB environment whose meta data cannot be read (not a cache of this
            format).
    """
    path = Path(path)
    if not (path / "data.mdb").is_file():
        raise FileNotFoundError(_missing_message(path))
    key = _key(path)
    env = _ENVS.get(key)
    short_lived = env is None
    try:
        if short_lived:
            _drop_inherited(key[1])
            env = _open_readonly(path)
        with env.begin() as txn:
            raw = {k: txn.get(k) for k in (_LEN, _SHAPE, _DTYPE, _SHA1, _COMPLETE, _FORMAT)}
    except lmdb.Error as exc:
        raise ValueError(f"cannot read the LMDB cache at {path}: {type(exc).__name__}: {exc}") from exc
    finally:
        if short_lived and env is not None:
            env.close()
    complete = raw[_COMPLETE] == b"1" and raw[_FORMAT] == _FORMAT_VERSION
    try:
        info = {
            "len": int(raw[_LEN]) if raw[_LEN] is not None else None,
            "shape": tuple(json.loads(raw[_SHAPE])) if raw[_SHAPE] is not None else None,
            "dtype": np.dtype(raw[_DTYPE].decode("ascii")) if raw[_DTYPE] is not None else None,
            "sha1": raw[_SHA1].decode("ascii") if raw[_SHA1] is not None else None,
        }
    except (ValueError, TypeError) as exc:
        raise ValueError(f"corrupt meta data in the LMDB cache at {path}: {exc}") from exc
    info["complete"] = complete and all(v is not None for v in info.values())
    return info


def _digest(images: np.ndarray, labels: np.ndarray) -> str:
    h = hashlib.sha1()
    h.update(repr((images.shape, images.dtype.str)).encode())
    h.update(memoryview(np.ascontiguousarray(images)).cast("B"))
    h.update(memoryview(np.ascontiguousarray(labels.astype(_LABEL_DTYPE))).cast("B"))
    return h.hexdigest()


def _write(path: Path, images: np.ndarray, labels: np.ndarray, sha1: str, map_size: int) -> None:
    n = images.shape[0]
    env = lmdb.open(str(path), map_size=map_size, subdir=True, meminit=False, map_async=True)
    try:
        start = 0
        while start < n:
            stop = min(start + _WRITE_BATCH, n)
            try:
                with env.begin(write=True) as txn:
                    for i in range(start, stop):
                        value = images[i].tobytes() + labels[i : i + 1].tobytes()
                        txn.put(str(i).encode("ascii"), value)
            except lmdb.MapFullError:
                map_size *= 2
                env.set_mapsize(map_size)
                continue  # the aborted batch is written again
            start = stop
        meta = {
            _LEN: str(n).encode("ascii"),
            _SHAPE: json.dumps(list(images.shape[1:])).encode("ascii"),
            _DTYPE: images.dtype.str.encode("ascii"),
            _SHA1: sha1.encode("ascii"),
            _FORMAT: _FORMAT_VERSION,
        }
        while True:
            try:
                with env.begin(write=True) as txn:
                    for k, v in meta.items():
                        txn.put(k, v)
                break
            except lmdb.MapFullError:
                map_size *= 2
                env.set_mapsize(map_size)
        with env.begin(write=True) as txn:  # the completion marker goes last, on its own
            txn.put(_COMPLETE, b"1")
        env.sync(True)
    finally:
        env.close()


def build_lmdb_cache(
    images: np.ndarray,
    labels: np.ndarray,
    path: str | Path,
    *,
    overwrite: bool = False,
    map_size: int | None = None,
) -> Path:
    """Write ``images`` and ``labels`` into an LMDB cache at ``path`` (a directory), once.

    If a complete cache of the same data (same length, shape, dtype and SHA-1) is already there, nothing is
    written. An incomplete or unreadable cache (an interrupted build) is rebuilt with a warning. A complete
    cache of *different* data raises, unless ``overwrite`` is True.

    Args:
        images: array ``[N, ...]`` (uint8 for images; any fixed-size dtype works).
        labels: integer array ``[N]``; stored as int64.
        path: cache directory.
        overwrite: rebuild even if a complete cache of other data exists at ``path``.
        map_size: initial LMDB map size in bytes (grown automatically when full); default from the data size.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: mismatched inputs, or a complete cache of other data at ``path`` and ``overwrite`` False.
    """
    path = Path(path)
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim < 1 or images.dtype.hasobject:
        raise ValueError(f"images must be a numeric array [N, ...], got {images.dtype} {images.shape}")
    if labels.shape != (images.shape[0],):
        raise ValueError(f"labels must have shape [{images.shape[0]}], got {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got {labels.dtype}")
    labels = labels.astype(_LABEL_DTYPE)
    sha1 = _digest(images, labels)

    if path.exists():
        try:
            info = lmdb_cache_info(path)
        except (FileNotFoundError, ValueError) as exc:
            info = {"complete": False, "error": str(exc)}
        if info["complete"]:
            same = (
                info["len"] == images.shape[0]
                and info["shape"] == images.shape[1:]
                and info["dtype"] == images.dtype
                and info["sha1"] == sha1
            )
            if same:
                return path
            if not overwrite:
                raise ValueError(
                    f"{path} holds a complete LMDB cache of different data ({info['len']} items of shape "
                    f"{info['shape']}, {info['dtype']}; requested {images.shape[0]} of {images.shape[1:]}, "
                    f"{images.dtype}). Delete it or pass overwrite=True."
                )
        else:
            warnings.warn(f"rebuilding the incomplete or unreadable LMDB cache at {path}", stacklevel=2)

    item_bytes = math.prod(images.shape[1:]) * images.dtype.itemsize + _LABEL_DTYPE.itemsize
    if map_size is None:
        # ~2x the payload plus page overhead; values over ~2 KiB take whole overflow pages
        map_size = max(1 << 24, 2 * images.shape[0] * (item_bytes + 64) + (1 << 22))
        if item_bytes > 2000:
            map_size += images.shape[0] * 4096
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _write(tmp, images, labels, sha1, map_size)
        _close_shared_env(path)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


class LMDBImageDataset(Dataset):
    """Map-style dataset over a cache written by :func:`build_lmdb_cache`; items are ``(image, label)``.

    ``image`` is a tensor of the stored dtype and per-image shape (uint8 ``[28, 28]`` for MNIST), ``label`` an
    int. The LMDB environment is opened lazily, read-only and without locking, on the first ``__getitem__`` of
    each process (the pid is recorded; a forked DataLoader worker opens its own), and is shared by all
    datasets over the same path in that process. Length and shape are read at construction through a
    short-lived environment, so ``len()`` never opens one. Instances pickle without their environment.

    Raises:
        FileNotFoundError: no cache at ``path``.
        ValueError: the cache is incomplete (interrupted build) or unreadable.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        info = lmdb_cache_info(self.path)
        if not info["complete"]:
            raise ValueError(
                f"the LMDB cache at {self.path} is incomplete (its build was interrupted); rebuild it with "
                "build_lmdb_cache()"
            )
        self._len: int = info["len"]
        self.image_shape: tuple[int, ...] = tuple(info["shape"])
        self.dtype: np.dtype = info["dtype"]
        self._image_bytes = math.prod(self.image_shape) * self.dtype.itemsize
        self._realpath = os.path.realpath(self.path)
        self._env: lmdb.Environment | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return self._len

    def _environment(self) -> lmdb.Environment:
        pid = os.getpid()
        if self._env is None or self._pid != pid or _ENVS.get((pid, self._realpath)) is not self._env:
            if not (self.path / "data.mdb").is_file():
                raise FileNotFoundError(_missing_message(self.path))
            self._env = _shared_env(self.path)
            self._pid = pid
        return self._env

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} items")
        with self._environment().begin() as txn:
            value = txn.get(str(index).encode("ascii"))
        if value is None or len(value) != self._image_bytes + _LABEL_DTYPE.itemsize:
            raise ValueError(f"the LMDB cache at {self.path} has a missing or malformed entry {index}")
        image = np.frombuffer(value, dtype=self.dtype, count=math.prod(self.image_shape)).reshape(
            self.image_shape
        )
        label = int(np.frombuffer(value, dtype=_LABEL_DTYPE, count=1, offset=self._image_bytes)[0])
        return torch.from_numpy(image.copy()), label

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_env"] = None
        state["_pid"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={str(self.path)!r}, len={self._len}, image_shape={self.image_shape})"
        )
