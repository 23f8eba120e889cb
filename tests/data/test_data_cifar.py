"""CIFAR-10 from torchvision's pickled batches (or their archive): pixels, splits, checksums, offline errors."""

import pickle

import numpy as np
import pytest
import torch

from deqscore.data import CIFAR10DataModule, CorruptDataError, DataNotFoundError
from deqscore.data.cifar import load_cifar10
from tests.data.fake_images import cifar_arrays, write_cifar10


@pytest.fixture(autouse=True)
def no_cifar_download(monkeypatch):
    import torchvision.datasets

    def refuse(*args, **kwargs):
        raise RuntimeError("network disabled in tests")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", type("Offline", (), {
        "__init__": refuse, "train_list": torchvision.datasets.CIFAR10.train_list,
        "test_list": torchvision.datasets.CIFAR10.test_list}))


@pytest.mark.parametrize("archive", [False, True])
def test_pixels_come_back_in_channel_major_order(tmp_path, archive):
    write_cifar10(tmp_path, per_batch=6, n_test=8, archive=archive)
    with pytest.warns(RuntimeWarning, match="MD5 differs"):
        train, labels = load_cifar10(tmp_path, train=True)
    expected = np.concatenate([cifar_arrays(6, i)[0] for i in range(1, 6)]).reshape(-1, 3, 32, 32)
    assert np.array_equal(train, expected) and len(labels) == 30
    assert labels.tolist() == sum((cifar_arrays(6, i)[1] for i in range(1, 6)), [])
    test, _ = load_cifar10(tmp_path, train=False)
    assert test.shape == (8, 3, 32, 32)


def test_the_data_module_serves_pixels_over_255_with_a_held_out_split(tmp_path):
    write_cifar10(tmp_path)
    dm = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=4, transform="pixels", val_fraction=0.2)
    with pytest.warns(RuntimeWarning):
        dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (24, 6, 8)
    raw = torch.from_numpy(dm.raw_images(True)).float() / 255
    x, _ = dm.val_dataset[0]
    assert torch.equal(x.view(3, 32, 32), raw[dm.val_dataset.indices[0]]) and dm.dim == 3072


def test_missing_files_name_the_archive_and_the_folder(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_cifar10(tmp_path, train=True, download=True)  # the download is refused in tests
    message = str(err.value)
    assert "data_batch_1" in message and "cifar-10-python.tar.gz" in message and str(tmp_path) in message


def test_an_unparseable_batch_is_corrupt_data_naming_the_file(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(CorruptDataError, match="data_batch_3"), pytest.warns(RuntimeWarning):
        load_cifar10(tmp_path, train=True)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_3", "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, fh)
    with pytest.raises(CorruptDataError, match=r"expected \[N, 3072\]"), pytest.warns(RuntimeWarning):
        load_cifar10(tmp_path, train=True)
