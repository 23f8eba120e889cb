"""An LMDB cache of (image, label) pairs that any image DataModule can use, and that checks itself.

Layout of a cache (an LMDB directory), format ``deqscore-lmdb-2``: key ``b"<index>"`` (ascii) -> raw image bytes,
the label as a little-endian int64, then a little-endian uint32 CRC-32 of the key and those bytes; meta keys
``__len__``, ``__shape__`` (per-image shape, JSON), ``__dtype__`` (numpy dtype string), ``__sha1__`` (of images,
labels, shape and dtype), ``__format__`` and ``__complete__``, written last, in a separate transaction. A cache is
built in a temporary directory and moved into place, so a complete-looking cache was written in full.

LMDB checksums nothing and maps its data file into memory, so a page read past the end of a truncated file kills
the process with SIGBUS. The cache therefore checks itself:

* **Truncation**, each time an environment is opened and in :func:`lmdb_cache_info`, before any data page is
  touched: LMDB's meta page (read with ``pread`` when the environment opens, and inside the first two pages)
  records ``last_pgno``, the highest page in use; every page the B-tree can reference is at or below it, so
  ``data.mdb`` must hold at least ``(last_pgno + 1) * page size`` bytes. The builder pads the file to that size,
  so a cache it wrote always passes. A file shorter than two pages is refused by LMDB itself. (A file truncated
  *while* a process has it open is not caught: that process can still die of SIGBUS.)
* **Flipped bytes**, on every read: the CRC-32 of the record (key included) is recomputed and compared. Measured
  on 28x28 uint8 MNIST items (shared 2-core 2.8 GHz Xeon, zlib 1.2.13): the check takes 1.4-1.9 us per item
  (crc32 runs at ~0.8 GB/s), i.e. ``__getitem__`` goes from 15-20 us to 17-23 us, about +10%.
* **The whole cache**, on request: ``lmdb_cache_info(path, verify=True)`` reads every item, checks its CRC and
  recomputes the SHA-1: 0.33-0.44 s for the 60 000 MNIST training images (page cache warm; the cheap check
  without ``verify`` takes under 1 ms). :func:`build_lmdb_cache` does it before keeping an existing cache of the
  same data, or refusing to replace one of other data.

Damage to LMDB's own B-tree pages is reported by LMDB (``lmdb.CorruptedError``, ``PageNotFoundError``, ...) and
re-raised as :class:`~deqscore.data.errors.CorruptDataError` naming the cache, although LMDB does not catch every
kind of such damage. Every error names the cache; the fix for a damaged one is to delete its directory and build
it again. :func:`lmdb_cache_info` reports a damaged, truncated, interrupted or older-format cache as not
``complete`` (with a ``problem``), and :func:`build_lmdb_cache` rebuilds it.

The builder is :mod:`deqscore.data.lmdb_build`.

>>> import numpy as np, tempfile
>>> from deqscore.data.lmdb_build import build_lmdb_cache
>>> images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
>>> path = build_lmdb_cache(images, np.array([3, 7]), tempfile.mkdtemp() + "/cache")
>>> ds = LMDBImageDataset(path)
>>> len(ds), ds[1][1], bool((ds[1][0].numpy() == images[1]).all())
(2, 7, True)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch
from torch.utils.data import Dataset

from deqscore.data.errors import CorruptDataError

__all__ = ["LMDBImageDataset", "lmdb_cache_info"]

_LEN = b"__len__"
_SHAPE = b"__shape__"
_DTYPE = b"__dtype__"
_SHA1 = b"__sha1__"
_COMPLETE = b"__complete__"
_FORMAT = b"__format__"
_META_KEYS = (_LEN, _SHAPE, _DTYPE, _SHA1, _COMPLETE, _FORMAT)
_FORMAT_VERSION = b"deqscore-lmdb-2"
_LABEL_DTYPE = np.dtype("<i8")
_CRC_BYTES = 4
_CRC_RESIDUE = 0x2144DF1C  # zlib.crc32(data + zlib.crc32(data).to_bytes(4, "little")) for any data
_WRITE_BATCH = 4096

# LMDB errors meaning that the files are damaged or are no LMDB environment, so that rebuilding helps; other LMDB
# errors come from the system (permissions, memory, disk) and keep their type, with the path added.
_DAMAGE_ERRORS = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.IncompatibleError,
    lmdb.PanicError,
    lmdb.ProblemError,
    lmdb.BadChecksumError,
)

# Read-only environments opened by this module, keyed by (pid, real path). LMDB forbids opening the same
# environment twice in one process and using an environment inherited through fork(); keying by pid gives each
# DataLoader worker its own. py-lmdb (>= 2) also remembers the files of every open environment and, after a
# fork, refuses to open them again in the child while the inherited handle is open: a child therefore closes
# the handles it inherited from this registry first. They are read-only and lock-free (no reader table), so
# closing the child's copy releases only the child's mapping and file descriptors, never the parent's.
_ENVS: dict[tuple[int, str], lmdb.Environment] = {}


# -- errors ------------------------------------------------------------------------------------------------------


def _fix_hint(path: Path) -> str:
    return (
        f"delete {path} and build it again with build_lmdb_cache() (ImageDataModule.prepare_data() rebuilds "
        "an unusable cache)"
    )


def _corruption(path: Path, problem: str) -> CorruptDataError:
    """A CorruptDataError for the cache at ``path``; ``.problem`` holds the diagnosis without the fix."""
    error = CorruptDataError(f"{problem}; {_fix_hint(path)}")
    error.problem = problem  # lmdb_cache_info reports it; build_lmdb_cache applies the fix itself
    return error


def _corrupt(path: Path, what: str) -> CorruptDataError:
    return _corruption(path, f"the LMDB cache at {path} {what}")


def _problem_of(error: CorruptDataError) -> str:
    return getattr(error, "problem", str(error))


def _wrap_lmdb_error(path: Path, exc: lmdb.Error) -> Exception:
    """``exc`` with the cache's path in its message: a CorruptDataError for damage, the same type otherwise."""
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, _DAMAGE_ERRORS):
        return _corruption(path, f"cannot read the LMDB cache at {path}, it is damaged ({what})")
    return type(exc)(f"cannot read the LMDB cache at {path}: {what}")


def _missing_message(path: Path) -> str:
    return f"no LMDB cache at {path} (expected a directory holding data.mdb); build it with build_lmdb_cache()"


# -- environments ------------------------------------------------------------------------------------------------


def _key(path: Path) -> tuple[int, str]:
    return os.getpid(), os.path.realpath(path)


def _open_readonly(path: Path) -> lmdb.Environment:
    return lmdb.open(str(path), readonly=True, lock=False, readahead=False, meminit=False, subdir=True, max_readers=512)


def _bytes_in_use(env: lmdb.Environment) -> int:
    """Bytes of the data file up to the end of the last page LMDB uses, from the meta page alone."""
    return (env.info()["last_pgno"] + 1) * env.stat()["psize"]


def _truncation(path: Path, env: lmdb.Environment) -> str | None:
    """Why reading ``env`` would hit the end of its file (SIGBUS), or None if it cannot."""
    size = os.stat(path / "data.mdb").st_size
    needed = _bytes_in_use(env)
    if size < needed:
        return f"is truncated: data.mdb holds {size} bytes but LMDB uses {needed}"
    return None


def _open_checked(path: Path) -> lmdb.Environment:
    """Open ``path`` read-only, refusing a damaged or truncated environment before any data page is read."""
    if os.stat(path / "data.mdb").st_size == 0:  # LMDB reports an empty file as EBADF, which says nothing
        raise _corrupt(path, "is empty (data.mdb holds 0 bytes)")
    try:
        env = _open_readonly(path)
    except lmdb.Error as exc:
        raise _wrap_lmdb_error(path, exc) from exc
    problem = _truncation(path, env)
    if problem is not None:
        env.close()
        raise _corrupt(path, problem)
    return env


def _drop_inherited(realpath: str) -> None:
    """Close this process's copies of the environments of ``realpath`` that a parent opened before forking."""
    pid = os.getpid()
    for key in [k for k in _ENVS if k[1] == realpath and k[0] != pid]:
        _ENVS.pop(key).close()


def _shared_env(path: Path) -> lmdb.Environment:
    """The read-only environment of ``path`` for this process, opened (and checked) on first use."""
    key = _key(path)
    env = _ENVS.get(key)
    if env is None:
        _drop_inherited(key[1])
        env = _ENVS[key] = _open_checked(path)
    return env


def _close_shared_env(path: Path) -> None:
    env = _ENVS.pop(_key(path), None)
    if env is not None:
        env.close()


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[lmdb.Environment]:
    """This process's environment of ``path`` (checked again) or a short-lived one; LMDB errors name ``path``."""
    key = _key(path)
    env = _ENVS.get(key)
    short_lived = env is None
    if short_lived:
        _drop_inherited(key[1])
        env = _open_checked(path)
    else:
        problem = _truncation(path, env)
        if problem is not None:
            _close_shared_env(path)  # its datasets notice and reopen, which fails cleanly
            raise _corrupt(path, problem)
    try:
        yield env
    except lmdb.Error as exc:
        raise _wrap_lmdb_error(path, exc) from exc
    finally:
        if short_lived:
            env.close()


# -- records -----------------------------------------------------------------------------------------------------


def _record(key: bytes, image: np.ndarray, label: np.ndarray) -> bytes:
    payload = image.tobytes() + label.tobytes()
    return payload + zlib.crc32(payload, zlib.crc32(key)).to_bytes(_CRC_BYTES, "little")


def _check_record(path: Path, index: int, key: bytes, value: Any, image_bytes: int) -> None:
    """Raise CorruptDataError unless ``value`` is an intact record of item ``index`` (stored under ``key``)."""
    expected = image_bytes + _LABEL_DTYPE.itemsize + _CRC_BYTES
    if value is None:
        raise _corrupt(path, f"has no item {index} (its key is missing)")
    if len(value) != expected:
        raise _corrupt(path, f"has an item {index} of {len(value)} bytes instead of {expected}")
    # The CRC-32 of data followed by its own little-endian CRC-32 is a constant: one pass over the record, no
    # slicing. The key is in the CRC so that a record found under another item's key is caught too.
    if zlib.crc32(value, zlib.crc32(key)) != _CRC_RESIDUE:
        raise _corrupt(path, f"has a damaged item {index} (its CRC-32 does not match its bytes)")


def _digest_start(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    h = hashlib.sha1()
    h.update(repr((tuple(shape), dtype.str)).encode())
    return h


def _flat_bytes(array: np.ndarray) -> np.ndarray:
    # a flat uint8 view hashes like memoryview(...).cast("B") but also works for empty arrays
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _digest(images: np.ndarray, labels: np.ndarray) -> str:
    h = _digest_start(images.shape, images.dtype)
    h.update(_flat_bytes(images))
    h.update(_flat_bytes(labels.astype(_LABEL_DTYPE)))
    return h.hexdigest()


# -- meta data and verification -----------------------------------------------------------------------------------


def _parse_meta(path: Path, raw: dict[bytes, bytes | None]) -> dict[str, Any]:
    """The info dict of the meta values ``raw``, with ``complete`` and ``problem`` filled in."""
    info: dict[str, Any] = {"len": None, "shape": None, "dtype": None, "sha1": None}
    fmt = raw[_FORMAT].decode("ascii", "replace") if raw[_FORMAT] is not None else None
    problem = None
    try:
        if raw[_LEN] is not None:
            info["len"] = int(raw[_LEN])
        if raw[_SHAPE] is not None:
            info["shape"] = tuple(int(d) for d in json.loads(raw[_SHAPE]))
        if raw[_DTYPE] is not None:
            info["dtype"] = np.dtype(raw[_DTYPE].decode("ascii"))
        if raw[_SHA1] is not None:
            info["sha1"] = raw[_SHA1].decode("ascii")
    except (ValueError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        problem = f"the LMDB cache at {path} has corrupt meta data ({type(exc).__name__}: {exc})"
    if raw[_COMPLETE] != b"1" or (problem is None and any(v is None for v in info.values())):
        problem = f"the LMDB cache at {path} is incomplete (its build was interrupted)"
    elif problem is None and raw[_FORMAT] != _FORMAT_VERSION:
        problem = (
            f"the LMDB cache at {path} was written in format {fmt!r}, but this version of deqscore reads "
            f"{_FORMAT_VERSION.decode()!r} only"
        )
    return {**info, "format": fmt, "complete": problem is None, "problem": problem}


def _verify_items(path: Path, env: lmdb.Environment, info: dict[str, Any]) -> None:
    """Check the CRC of every item and the SHA-1 of the whole content; raises CorruptDataError."""
    n, shape, dtype = info["len"], info["shape"], info["dtype"]
    image_bytes = math.prod(shape) * dtype.itemsize
    h = _digest_start((n, *shape), dtype)
    labels = bytearray()  # the SHA-1 covers all images, then all labels
    with env.begin(buffers=True) as txn:  # buffers: no copy of each record
        for index in range(n):
            key = str(index).encode("ascii")
            value = txn.get(key)
            _check_record(path, index, key, value, image_bytes)
            h.update(value[:image_bytes])
            labels += value[image_bytes:-_CRC_BYTES]
    h.update(labels)
    if h.hexdigest() != info["sha1"]:
        raise _corrupt(path, f"does not match its SHA-1 ({info['sha1']} stored, {h.hexdigest()} computed)")


def lmdb_cache_info(path: str | Path, *, verify: bool = False) -> dict[str, Any]:
    """The meta keys of the cache at ``path`` (``len``, ``shape``, ``dtype``, ``sha1``, ``format``), ``complete``
    and ``problem``, checking that it can be read safely (with ``verify``: every item's CRC-32 and the SHA-1).

    ``complete`` is False, and ``problem`` names ``path`` and what is wrong, for an interrupted build, an older
    format, a truncated or damaged file (the other values None if the meta data cannot be read) or a damaged item.
    ``FileNotFoundError`` if ``path`` holds no LMDB environment; ``lmdb.Error`` naming ``path`` for other failures.
    """
    path = Path(path)
    if not (path / "data.mdb").is_file():
        raise FileNotFoundError(_missing_message(path))
    try:
        with _reading(path) as env, env.begin() as txn:
            raw = {k: txn.get(k) for k in _META_KEYS}
    except CorruptDataError as exc:
        unknown = dict.fromkeys(("len", "shape", "dtype", "sha1", "format"))
        return {**unknown, "complete": False, "problem": _problem_of(exc)}
    info = _parse_meta(path, raw)
    if verify and info["complete"]:
        try:
            with _reading(path) as env:
                _verify_items(path, env, info)
        except CorruptDataError as exc:
            info.update(complete=False, problem=_problem_of(exc))
    return info


# -- reading -----------------------------------------------------------------------------------------------------


class LMDBImageDataset(Dataset):
    """Map-style dataset of ``(image tensor, int label)`` over a cache written by :func:`build_lmdb_cache`.

    The environment is opened lazily, read-only and without locking, on the first ``__getitem__`` of each process
    (a forked DataLoader worker opens its own) and shared by the datasets of that path in the process; instances
    pickle without it. A cache that is incomplete, truncated, damaged or of an older format raises
    :class:`CorruptDataError` naming it, at construction or, for a damaged item, from ``__getitem__``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        info = lmdb_cache_info(self.path)
        if not info["complete"]:
            raise CorruptDataError(f"{info['problem']}; {_fix_hint(self.path)}")
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
        key = str(index).encode("ascii")
        try:
            with self._environment().begin() as txn:
                value = txn.get(key)
        except lmdb.Error as exc:
            raise _wrap_lmdb_error(self.path, exc) from exc
        _check_record(self.path, index, key, value, self._image_bytes)
        image = np.frombuffer(value, dtype=self.dtype, count=math.prod(self.image_shape))
        label = int.from_bytes(value[self._image_bytes : -_CRC_BYTES], "little", signed=True)
        return torch.from_numpy(image.reshape(self.image_shape).copy()), label

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_env"] = None
        state["_pid"] = None
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={str(self.path)!r}, len={self._len}, image_shape={self.image_shape})"
