"""LMDB image cache: exact round trip, build-once, incomplete caches, lazy per-process opening, workers, and the
self-checks: truncation (no SIGBUS), per-item CRC, damaged pages, older formats."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from deqscore.data import CorruptDataError, LMDBImageDataset, build_lmdb_cache, lmdb_cache_info
from deqscore.data import lmdb_cache as lmdb_module

N = 300


@pytest.fixture(scope="module")
def small(mnist_train) -> tuple[np.ndarray, np.ndarray]:
    return mnist_train[0][:N].copy(), mnist_train[1][:N].copy()


@pytest.fixture
def cache(tmp_path, small):
    return build_lmdb_cache(*small, tmp_path / "cache")


def test_round_trip_exact_bytes(cache, small):
    images, labels = small
    ds = LMDBImageDataset(cache)
    assert len(ds) == N and ds.image_shape == (28, 28) and ds.dtype == np.uint8
    for i in range(N):
        image, label = ds[i]
        assert image.dtype == torch.uint8 and image.shape == (28, 28)
        assert image.numpy().tobytes() == images[i].tobytes()
        assert isinstance(label, int) and label == labels[i]
    assert torch.equal(ds[-1][0], torch.from_numpy(images[-1]))
    with pytest.raises(IndexError):
        ds[N]
    info = lmdb_cache_info(cache)
    assert info["complete"] and info["len"] == N and info["shape"] == (28, 28)
    assert info["problem"] is None and info["format"] == "deqscore-lmdb-2"


def test_intact_cache_verifies_and_reads_back_the_arrays(cache, small):
    images, labels = small
    info = lmdb_cache_info(cache, verify=True)
    assert info["complete"] and info["problem"] is None
    ds = LMDBImageDataset(cache)
    items = [ds[i] for i in range(N)]
    assert np.array_equal(torch.stack([image for image, _ in items]).numpy(), images)
    assert np.array_equal(np.array([label for _, label in items]), labels)


def test_len_does_not_open_an_environment(cache):
    ds = LMDBImageDataset(cache)
    assert len(ds) == N
    assert ds._env is None
    assert (os.getpid(), os.path.realpath(cache)) not in lmdb_module._ENVS
    ds[0]
    assert ds._env is lmdb_module._ENVS[(os.getpid(), os.path.realpath(cache))]
    # a second dataset over the same cache shares the environment: never opened twice in one process
    other = LMDBImageDataset(cache)
    other[1]
    assert other._env is ds._env


def test_second_build_is_skipped_and_other_data_refused(cache, small):
    data_file = cache / "data.mdb"
    before = data_file.stat().st_mtime_ns
    assert build_lmdb_cache(*small, cache) == cache
    assert data_file.stat().st_mtime_ns == before
    images, labels = small
    changed = images.copy()
    changed[5, 3, 3] ^= 1
    with pytest.raises(ValueError, match="different data"):
        build_lmdb_cache(changed, labels, cache)
    ds = LMDBImageDataset(cache)
    ds[5]  # an open environment must not stop a rebuild
    build_lmdb_cache(changed, labels, cache, overwrite=True)
    assert torch.equal(ds[5][0], torch.from_numpy(changed[5]))
    assert torch.equal(LMDBImageDataset(cache)[5][0], torch.from_numpy(changed[5]))


def test_incomplete_cache_is_reported_then_rebuilt(tmp_path, small):
    images, labels = small
    path = tmp_path / "partial"
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:  # an interrupted build: a few items, no meta keys, no marker
        for i in range(10):
            txn.put(str(i).encode(), images[i].tobytes() + labels[i : i + 1].astype("<i8").tobytes())
    env.close()
    assert not lmdb_cache_info(path)["complete"]
    with pytest.raises(ValueError, match="incomplete"):
        LMDBImageDataset(path)
    with pytest.warns(UserWarning, match="rebuilding"):
        build_lmdb_cache(images, labels, path)
    ds = LMDBImageDataset(path)
    assert len(ds) == N and torch.equal(ds[123][0], torch.from_numpy(images[123]))


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no LMDB cache at .*nowhere"):
        LMDBImageDataset(tmp_path / "nowhere")


def test_map_grows_when_full(tmp_path, small):
    images, labels = small
    path = build_lmdb_cache(images, labels, tmp_path / "tiny", map_size=1 << 16)
    ds = LMDBImageDataset(path)
    assert len(ds) == N
    assert all(torch.equal(ds[i][0], torch.from_numpy(images[i])) for i in (0, 150, N - 1))


def test_pickling_drops_the_environment(cache, small):
    ds = LMDBImageDataset(cache)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._env is None and clone._pid is None and len(clone) == N
    assert torch.equal(clone[7][0], torch.from_numpy(small[0][7])) and clone[7][1] == small[1][7]


class _PidDataset(torch.utils.data.Dataset):
    """Reports which process read an item and which environment it used."""

    def __init__(self, inner: LMDBImageDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        image, label = self.inner[i]
        return image, label, os.getpid(), id(self.inner._env)


def test_dataloader_with_forked_workers(cache, small):
    images, labels = small
    ds = LMDBImageDataset(cache)
    ds[0]  # the parent has an open environment before forking: the workers must not reuse it
    parent_env = id(ds._env)
    loader = DataLoader(
        _PidDataset(ds),
        batch_size=32,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context("fork"),
    )
    got_images, got_labels, pids, envs = [], [], set(), set()
    for image, label, pid, env in loader:
        got_images.append(image)
        got_labels.append(label)
        pids.update(pid.tolist())
        envs.update(env.tolist())
    assert np.array_equal(torch.cat(got_images).numpy(), images)
    assert np.array_equal(torch.cat(got_labels).numpy(), labels)
    assert len(pids) == 2 and os.getpid() not in pids
    assert parent_env not in envs
    # the workers closed only their own copies: the parent's environment still reads
    assert id(ds._env) == parent_env and torch.equal(ds[N - 1][0], torch.from_numpy(images[N - 1]))


def test_garbage_cache_file_is_reported_then_rebuilt(tmp_path, small):
    path = tmp_path / "garbage"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"this is not an lmdb file" * 100)
    with pytest.raises(ValueError, match="cannot read the LMDB cache at .*garbage"):
        LMDBImageDataset(path)
    with pytest.warns(UserWarning, match="rebuilding"):
        build_lmdb_cache(*small, path)
    assert torch.equal(LMDBImageDataset(path)[3][0], torch.from_numpy(small[0][3]))


# -- self-checks ---------------------------------------------------------------------------------------------------

# Run in a child process, because reading past the end of a truncated, memory-mapped file kills the reader with
# SIGBUS. argv: two truncated caches, a pickled dataset over the first made before its truncation, and an intact
# cache that the child opens and then truncates itself. Prints one JSON line per check, then opens the first cache
# with no try/except: that must end in a traceback, not a signal.
_READ_TRUNCATED = """
import json, os, pickle, sys
from deqscore.data import LMDBImageDataset, lmdb_cache_info

def report(**kw):
    print(json.dumps(kw), flush=True)

def read(dataset):
    try:
        dataset[len(dataset) - 1]
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

half, short, pickled, live = sys.argv[1:]
for path in (half, short):
    info = lmdb_cache_info(path)
    report(path=path, complete=info["complete"], problem=info["problem"])
report(read=read(pickle.loads(open(pickled, "rb").read())))  # opens the truncated cache on its first read
opened = LMDBImageDataset(live)
report(read=read(opened))  # intact: the environment is now open in this process
os.truncate(os.path.join(live, "data.mdb"), os.path.getsize(os.path.join(live, "data.mdb")) // 2)
info = lmdb_cache_info(live)  # checks the open environment again, and drops it
report(path=live, complete=info["complete"], problem=info["problem"])
report(read=read(opened))
LMDBImageDataset(half)
"""


def _copy_cache(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_truncated_cache_is_a_clean_error_not_sigbus(tmp_path, small):
    intact = build_lmdb_cache(*small, tmp_path / "intact")
    size = (intact / "data.mdb").stat().st_size
    half, short, live = (_copy_cache(intact, tmp_path / name) for name in ("half", "short", "live"))
    pickled = tmp_path / "dataset.pkl"
    pickled.write_bytes(pickle.dumps(LMDBImageDataset(half)))  # made while the cache is intact
    os.truncate(half / "data.mdb", size // 2)
    os.truncate(short / "data.mdb", size - 4096)  # the sharpest cut: only the last page goes
    run = subprocess.run(
        [sys.executable, "-c", _READ_TRUNCATED, str(half), str(short), str(pickled), str(live)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode != -signal.SIGBUS, f"the reader died of SIGBUS; stdout {run.stdout!r}"
    assert run.returncode == 1, f"rc {run.returncode}; stdout {run.stdout!r}; stderr {run.stderr[-2000:]}"
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(lines) == 6, run.stdout
    for line, path in zip([lines[0], lines[1], lines[4]], (half, short, live), strict=True):
        assert line["path"] == str(path) and line["complete"] is False
        assert "truncated" in line["problem"] and str(path) in line["problem"]
    assert lines[2]["read"].startswith("CorruptDataError") and str(half) in lines[2]["read"]
    assert lines[3]["read"] == "no error"
    assert lines[5]["read"].startswith("CorruptDataError") and str(live) in lines[5]["read"]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("deqscore.data.errors.CorruptDataError:") and "truncated" in last
    assert str(half) in last and "build_lmdb_cache" in last
    # the recovery path of ImageDataModule.prepare_data(): the cache is rebuilt and reads back exactly
    with pytest.warns(UserWarning, match="rebuilding .*truncated"):
        build_lmdb_cache(*small, half)
    assert lmdb_cache_info(half, verify=True)["complete"]
    assert torch.equal(LMDBImageDataset(half)[N - 1][0], torch.from_numpy(small[0][N - 1]))


def _live_record_offset(data: bytes, images: np.ndarray) -> tuple[int, int]:
    """``(index, offset)`` of an item in the middle whose image bytes occur once in ``data``.

    LMDB leaves stale copies of records in pages it split or copied; bytes found exactly once must be the live
    record, because the cache reads back intact.
    """
    for index in range(len(images) // 2, len(images)):
        image = images[index].tobytes()
        if data.count(image) == 1:
            return index, data.index(image)
    raise AssertionError("every record has stale copies in data.mdb")


@pytest.mark.parametrize("where", [400, 28 * 28], ids=["image-byte", "label-byte"])
def test_flipped_byte_in_a_record_is_caught(cache, small, where):
    images, labels = small
    data = bytearray((cache / "data.mdb").read_bytes())
    index, offset = _live_record_offset(bytes(data), images)
    data[offset + where] ^= 0x01
    (cache / "data.mdb").write_bytes(data)

    ds = LMDBImageDataset(cache)  # the meta data is intact: the damage shows when the item is read
    with pytest.raises(CorruptDataError, match=rf"{re.escape(str(cache))} has a damaged item {index} .*CRC"):
        ds[index]
    assert torch.equal(ds[index - 1][0], torch.from_numpy(images[index - 1]))  # the other items still read
    assert lmdb_cache_info(cache)["complete"]  # the cheap check reads meta data only...
    info = lmdb_cache_info(cache, verify=True)  # ...the full one reads every item
    assert not info["complete"] and f"damaged item {index}" in info["problem"] and str(cache) in info["problem"]
    with pytest.warns(UserWarning, match=f"rebuilding .*damaged item {index}"):
        build_lmdb_cache(images, labels, cache)  # same data, so it would be kept if it were not verified
    ds = LMDBImageDataset(cache)
    assert torch.equal(ds[index][0], torch.from_numpy(images[index])) and ds[index][1] == labels[index]


def test_damaged_lmdb_page_names_the_cache(cache, small):
    images = small[0]
    data = bytearray((cache / "data.mdb").read_bytes())
    index, offset = _live_record_offset(bytes(data), images)
    page = offset // 4096
    data[page * 4096 : (page + 1) * 4096] = bytes(4096)  # the leaf page of that item, header included
    (cache / "data.mdb").write_bytes(data)
    ds = LMDBImageDataset(cache)
    with pytest.raises(CorruptDataError, match=rf"cannot read the LMDB cache at {re.escape(str(cache))}.*Corrupted"):
        ds[index]
    info = lmdb_cache_info(cache, verify=True)
    assert not info["complete"] and "CorruptedError" in info["problem"] and str(cache) in info["problem"]


def _write_format_1_cache(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """A complete cache in the layout of format deqscore-lmdb-1: records without a CRC."""
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in range(len(images)):
            txn.put(str(i).encode(), images[i].tobytes() + labels[i : i + 1].astype("<i8").tobytes())
        txn.put(b"__len__", str(len(images)).encode())
        txn.put(b"__shape__", json.dumps(list(images.shape[1:])).encode())
        txn.put(b"__dtype__", images.dtype.str.encode())
        txn.put(b"__sha1__", lmdb_module._digest(images, labels).encode())
        txn.put(b"__format__", b"deqscore-lmdb-1")
    with env.begin(write=True) as txn:
        txn.put(b"__complete__", b"1")
    env.close()


def test_older_format_cache_needs_a_rebuild(tmp_path, small):
    images, labels = small
    path = tmp_path / "old"
    _write_format_1_cache(path, images, labels)
    info = lmdb_cache_info(path)
    assert not info["complete"] and info["format"] == "deqscore-lmdb-1" and info["len"] == N
    assert "format 'deqscore-lmdb-1'" in info["problem"] and str(path) in info["problem"]
    with pytest.raises(CorruptDataError, match="deqscore-lmdb-1.*build_lmdb_cache"):
        LMDBImageDataset(path)
    with pytest.warns(UserWarning, match="rebuilding .*deqscore-lmdb-1"):
        build_lmdb_cache(images, labels, path)
    assert lmdb_cache_info(path, verify=True)["complete"]
    assert torch.equal(LMDBImageDataset(path)[42][0], torch.from_numpy(images[42]))


def test_empty_data_file_is_reported(tmp_path, small):
    path = tmp_path / "empty"
    path.mkdir()
    (path / "data.mdb").touch()
    info = lmdb_cache_info(path)
    assert not info["complete"] and "is empty" in info["problem"] and str(path) in info["problem"]
    with pytest.raises(CorruptDataError, match="empty"):
        LMDBImageDataset(path)
    with pytest.warns(UserWarning, match="rebuilding .*empty"):
        build_lmdb_cache(*small, path)
    assert lmdb_cache_info(path)["complete"]


def test_other_lmdb_errors_keep_their_type_and_name_the_cache(cache, monkeypatch):
    def fail(path):
        raise lmdb.DiskError("Input/output error")

    monkeypatch.setattr(lmdb_module, "_open_readonly", fail)
    with pytest.raises(lmdb.DiskError, match=f"cannot read the LMDB cache at {re.escape(str(cache))}: DiskError"):
        lmdb_cache_info(cache)


def test_damaged_checksum_in_the_meta_data_is_caught(cache, small):
    images, labels = small
    sha1 = lmdb_cache_info(cache)["sha1"].encode()
    data = (cache / "data.mdb").read_bytes()
    assert sha1 in data
    damaged = sha1[:-1] + (b"0" if sha1[-1:] != b"0" else b"1")
    (cache / "data.mdb").write_bytes(data.replace(sha1, damaged))  # stale copies too: one of them is live
    assert lmdb_cache_info(cache)["complete"]  # well-formed meta data, so the cheap check cannot tell...
    info = lmdb_cache_info(cache, verify=True)  # ...but the SHA-1 of the items no longer matches
    assert not info["complete"] and "does not match its SHA-1" in info["problem"]
    # to the cheap check the cache looks like one of other data: verifying it first leads to a rebuild, not a refusal
    with pytest.warns(UserWarning, match="rebuilding .*SHA-1"):
        build_lmdb_cache(images, labels, cache)
    assert lmdb_cache_info(cache, verify=True)["complete"]
