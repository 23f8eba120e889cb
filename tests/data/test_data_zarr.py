"""The zarr v3 zip reader on handmade stores: chunk grids, codecs, key encodings, missing chunks, errors."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numcodecs
import numpy as np
import pytest

from deqscore.data.errors import CorruptDataError
from deqscore.data.zarr import read_zarr_zip_array

_CODECS = {
    "blosc": numcodecs.Blosc(cname="zstd", clevel=3),
    "zstd": numcodecs.Zstd(),
    "gzip": numcodecs.GZip(level=5),
}


def _write_zarr_zip(
    path: Path,
    array: np.ndarray,
    chunks: tuple[int, ...],
    skip: set[tuple[int, ...]],
    codec: str = "blosc",
    encoding: str = "default",
) -> None:
    separator = "/" if encoding == "default" else "."
    meta = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(array.shape),
        "data_type": str(array.dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": encoding, "configuration": {"separator": separator}},
        "fill_value": 9,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": codec}],
    }
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("zarr.json", json.dumps({"zarr_format": 3, "node_type": "group"}))
        zf.writestr("a/zarr.json", json.dumps(meta))
        grid = [range(-(-s // c)) for s, c in zip(array.shape, chunks, strict=True)]
        for index in np.ndindex(*[len(g) for g in grid]):
            if index in skip:
                continue
            block = np.zeros(chunks, dtype=array.dtype)  # edge chunks are stored full size, padded
            part = array[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunks, strict=True))]
            block[tuple(slice(0, n) for n in part.shape)] = part
            key = "a/c/" + "/".join(map(str, index)) if encoding == "default" else "a/" + ".".join(map(str, index))
            zf.writestr(key, _CODECS[codec].encode(block.astype("<" + array.dtype.str[1:])))


def test_zarr_reader_on_a_handmade_store(tmp_path):
    rng = np.random.default_rng(0)
    array = rng.integers(0, 1000, size=(5, 7), dtype=np.int32)
    path = tmp_path / "a.zarr.zip"
    _write_zarr_zip(path, array, (2, 3), skip=set())
    assert np.array_equal(read_zarr_zip_array(path, "a"), array)
    # a missing chunk is an error by default and the fill value when allowed
    _write_zarr_zip(path, array, (2, 3), skip={(1, 2)})
    with pytest.raises(CorruptDataError, match="missing chunk 'a/c/1/2'"):
        read_zarr_zip_array(path, "a")
    got = read_zarr_zip_array(path, "a", allow_missing_chunks=True)
    expected = array.copy()
    expected[2:4, 6:7] = 9
    assert np.array_equal(got, expected)
    with pytest.raises(FileNotFoundError):
        read_zarr_zip_array(tmp_path / "nope.zip", "a")


@pytest.mark.parametrize("codec", ["zstd", "gzip"])
@pytest.mark.parametrize("encoding", ["default", "v2"])
def test_zarr_reader_codecs_and_key_encodings(tmp_path, codec, encoding):
    array = np.random.default_rng(1).integers(0, 256, size=(3, 5, 4), dtype=np.uint8)
    path = tmp_path / "b.zarr.zip"
    _write_zarr_zip(path, array, (2, 2, 3), skip=set(), codec=codec, encoding=encoding)
    assert np.array_equal(read_zarr_zip_array(path, "a"), array)


def test_zarr_reader_errors_name_file_and_array(tmp_path):
    path = tmp_path / "c.zarr.zip"
    _write_zarr_zip(path, np.zeros((2, 2), np.uint8), (2, 2), skip=set())
    with pytest.raises(CorruptDataError, match=r"c\.zarr\.zip: no zarr array 'b'"):
        read_zarr_zip_array(path, "b")
    path.write_bytes(b"not a zip")
    with pytest.raises(CorruptDataError, match=r"cannot read zarr zip archive .*c\.zarr\.zip: BadZipFile"):
        read_zarr_zip_array(path, "a")
