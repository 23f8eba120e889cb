"""LMDB image cache: exact round trip, build-once, incomplete caches, lazy per-process opening, workers."""

from __future__ import annotations

import multiprocessing
import os
import pickle

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from deqscore.data import LMDBImageDataset, build_lmdb_cache, lmdb_cache_info
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
