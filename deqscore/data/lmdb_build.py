"""Building the LMDB cache of :mod:`deqscore.data.lmdb_cache` (its layout and checks are described there): written
in batches to a temporary directory, padded to the pages in use, verified and moved into place; an existing cache
of the same data is kept, one of other data replaced only when asked."""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from deqscore.data.lmdb_cache import (  # the format and its checks, shared with the reader
    _COMPLETE,
    _CRC_BYTES,
    _DTYPE,
    _FORMAT,
    _FORMAT_VERSION,
    _LABEL_DTYPE,
    _LEN,
    _SHA1,
    _SHAPE,
    _WRITE_BATCH,
    _bytes_in_use,
    _close_shared_env,
    _digest,
    _open_readonly,
    _record,
    lmdb_cache_info,
)
from deqscore.files import staged

__all__ = ["build_lmdb_cache"]


def _records(images: np.ndarray, labels: np.ndarray, start: int, stop: int) -> list[tuple[bytes, bytes]]:
    keys = [str(i).encode("ascii") for i in range(start, stop)]
    return [(k, _record(k, images[i], labels[i : i + 1])) for k, i in zip(keys, range(start, stop), strict=True)]


def _put_with_growth(env: lmdb.Environment, items: list[tuple[bytes, bytes]], map_size: int) -> int:
    """Write ``items`` in one transaction, doubling the map while it is full; returns the map size."""
    while True:
        try:
            with env.begin(write=True) as txn:
                for k, v in items:
                    txn.put(k, v)
            return map_size
        except lmdb.MapFullError:
            map_size *= 2
            env.set_mapsize(map_size)  # the aborted transaction is written again


def _pad_to_pages_in_use(path: Path) -> None:
    """Make data.mdb at least as long as LMDB's pages in use, the criterion readers check against truncation."""
    env = _open_readonly(path)
    try:
        needed = _bytes_in_use(env)
    finally:
        env.close()
    # LMDB writes every page it hands out, except one freed again in the same transaction: such a page is in the
    # free list, never read, so zeros in its place are harmless
    if os.stat(path / "data.mdb").st_size < needed:
        os.truncate(path / "data.mdb", needed)


def _write(path: Path, images: np.ndarray, labels: np.ndarray, sha1: str, map_size: int) -> None:
    n = images.shape[0]
    env = lmdb.open(str(path), map_size=map_size, subdir=True, meminit=False, map_async=True)
    try:
        for start in range(0, n, _WRITE_BATCH):
            map_size = _put_with_growth(env, _records(images, labels, start, min(start + _WRITE_BATCH, n)), map_size)
        meta = {
            _LEN: str(n).encode("ascii"),
            _SHAPE: json.dumps(list(images.shape[1:])).encode("ascii"),
            _DTYPE: images.dtype.str.encode("ascii"),
            _SHA1: sha1.encode("ascii"),
            _FORMAT: _FORMAT_VERSION,
        }
        map_size = _put_with_growth(env, list(meta.items()), map_size)
        _put_with_growth(env, [(_COMPLETE, b"1")], map_size)  # the completion marker goes last, on its own
        env.sync(True)
    finally:
        env.close()
    _pad_to_pages_in_use(path)


def _existing_info(path: Path) -> dict[str, Any]:
    try:
        return lmdb_cache_info(path)
    except FileNotFoundError as exc:  # a file or an empty directory in the way
        return {"complete": False, "problem": str(exc)}


def _same_data(info: dict[str, Any], images: np.ndarray, sha1: str) -> bool:
    return (
        info["len"] == images.shape[0]
        and info["shape"] == images.shape[1:]
        and info["dtype"] == images.dtype
        and info["sha1"] == sha1
    )


def _needs_build(path: Path, images: np.ndarray, sha1: str, overwrite: bool) -> bool:
    """Whether to (re)build the cache at ``path``; raises if it holds other data and ``overwrite`` is False."""
    if not path.exists():
        return True
    info = _existing_info(path)
    if info["complete"] and overwrite and not _same_data(info, images, sha1):
        return True
    if info["complete"]:
        # about to keep it, or to refuse to replace it: check every item (damaged meta data can look like other data)
        info = lmdb_cache_info(path, verify=True)
    if not info["complete"]:
        warnings.warn(f"rebuilding the unusable LMDB cache at {path}: {info['problem']}", stacklevel=3)
        return True
    if _same_data(info, images, sha1):
        return False
    raise ValueError(
        f"{path} holds a complete LMDB cache of different data ({info['len']} items of shape "
        f"{info['shape']}, {info['dtype']}; requested {images.shape[0]} of {images.shape[1:]}, "
        f"{images.dtype}). Delete it or pass overwrite=True."
    )


def _default_map_size(images: np.ndarray) -> int:
    item_bytes = math.prod(images.shape[1:]) * images.dtype.itemsize + _LABEL_DTYPE.itemsize + _CRC_BYTES
    # ~2x the payload plus page overhead; values over ~2 KiB take whole overflow pages
    map_size = max(1 << 24, 2 * images.shape[0] * (item_bytes + 64) + (1 << 22))
    if item_bytes > 2000:
        map_size += images.shape[0] * 4096
    return map_size


def build_lmdb_cache(
    images: np.ndarray,
    labels: np.ndarray,
    path: str | Path,
    *,
    overwrite: bool = False,
    map_size: int | None = None,
) -> Path:
    """Write ``images`` and ``labels`` into an LMDB cache at ``path`` (a directory), once.

    If a complete cache of the same data (same length, shape, dtype and SHA-1) is already there, it is verified
    (every item's CRC and the SHA-1, see :func:`lmdb_cache_info`) and, if intact, kept: nothing is written. An
    unusable cache (interrupted build, truncated or damaged file, older format) is rebuilt with a warning. A
    complete cache of *different* data is verified too (damaged meta data can look like other data) and, if
    intact, raises, unless ``overwrite`` is True (then it is replaced without being read).

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
    if not _needs_build(path, images, sha1, overwrite):
        return path

    path.parent.mkdir(parents=True, exist_ok=True)
    with staged([path]) as (tmp,):
        _write(tmp, images, labels, sha1, map_size or _default_map_size(images))
        _close_shared_env(path)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return path


