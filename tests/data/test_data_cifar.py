"""CIFAR-10 from torchvision's pickled batches (or their archive): pixels and channel order, splits, checksums,
restricted unpickling, offline and corrupt-file errors, the LMDB cache and seeded flips."""

import hashlib
import os
import pickle
import shutil
import urllib.request
import warnings

import numpy as np
import pytest
import torch

from deqscore.data import CIFAR10DataModule, CorruptDataError, DataNotFoundError
from deqscore.data import cifar as cifar_module
from deqscore.data.cifar import load_cifar10
from tests.data.fake_images import cifar_arrays, write_cifar10

BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
DOWNLOADS: list[tuple] = []  # the (root, train) of every attempted torchvision download


@pytest.fixture(autouse=True)
def no_cifar_download(monkeypatch):
    """torchvision's CIFAR10 (the only downloader) records the attempt and fails; urlopen fails too."""
    import torchvision.datasets

    def refuse(self, root, train=True, download=False, **kwargs):
        DOWNLOADS.append((root, train))
        raise RuntimeError("network disabled in tests")

    def no_network(*args, **kwargs):
        raise AssertionError("a test touched the network")

    DOWNLOADS.clear()
    real = torchvision.datasets.CIFAR10
    offline = type("OfflineCIFAR10", (), {"__init__": refuse, "train_list": real.train_list,
                                          "test_list": real.test_list})
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    monkeypatch.setattr(urllib.request, "urlopen", no_network)


@pytest.fixture
def quiet():
    """Silence the checksum warning of the fake files (other warnings still show)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "MD5 differs from the CIFAR-10 original")
        yield


def _train_pixels(per_batch: int = 6) -> np.ndarray:
    """The fake train split as written, [N, 3072]."""
    return np.concatenate([cifar_arrays(per_batch, i)[0] for i in range(1, 6)])


@pytest.mark.parametrize("archive", [False, True])
def test_pixels_and_labels_come_back_from_the_files_or_the_archive(tmp_path, archive):
    write_cifar10(tmp_path, per_batch=6, n_test=8, archive=archive)
    with pytest.warns(RuntimeWarning, match="MD5 differs") as record:
        train, labels = load_cifar10(tmp_path, train=True)
    assert [n for n in BATCHES if any(f"/{n} has" in str(w.message) for w in record)] == BATCHES  # one per file
    assert train.dtype == np.uint8 and np.array_equal(train, _train_pixels().reshape(-1, 3, 32, 32))
    assert labels.dtype == np.int64 and labels.tolist() == sum((cifar_arrays(6, i)[1] for i in range(1, 6)), [])
    with pytest.warns(RuntimeWarning, match="MD5 differs"):
        test, test_labels = load_cifar10(tmp_path, train=False)
    assert np.array_equal(test.reshape(8, -1), cifar_arrays(8, 0)[0]) and test_labels.tolist() == cifar_arrays(8, 0)[1]
    assert (tmp_path / "cifar-10-batches-py" / "test_batch").is_file()  # the archive was extracted


def _planes(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows as the CIFAR-10 format defines them: red plane (value = row), green (= column), blue (= 7 * image),
    each 32x32 in row-major order; also the images as HWC."""
    rows, cols = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    hwc = np.stack([np.stack([rows, cols, np.full((32, 32), 7 * i)], axis=-1) for i in range(n)]).astype(np.uint8)
    data = np.concatenate([hwc[..., c].reshape(n, 1024) for c in range(3)], axis=1)
    return data, hwc


def _write_like_the_originals(folder, name: str, data: np.ndarray, labels: list[int]) -> None:
    """Pickle protocol 2 with numpy 1's module names, as in the files of the CIFAR-10 site."""
    raw = pickle.dumps({b"batch_label": b"fake", b"labels": labels, b"data": data}, protocol=2)
    (folder / name).write_bytes(raw.replace(b"numpy._core.", b"numpy.core."))


def test_items_are_channel_major_pixels_over_255(tmp_path, quiet):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    data, hwc = _planes(4)
    for name in [*BATCHES, "test_batch"]:
        _write_like_the_originals(folder, name, data, [1, 2, 3, 4])
    assert b"numpy.core.multiarray" in (folder / "test_batch").read_bytes()
    dm = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=2, transform="pixels")
    dm.setup("test")
    for i in range(4):
        x, label = dm.test_dataset[i]
        image = x.view(3, 32, 32)
        assert label == i + 1
        # channel 0 is red (= row index), 1 green (= column index), 2 blue; exactly k / 255
        assert torch.equal(image, torch.from_numpy(hwc[i]).permute(2, 0, 1).float() / 255)
        assert image[0, 5, 9] == 5 / 255 and image[1, 5, 9] == 9 / 255 and image[2, 0, 0] == 7 * i / 255


def test_the_data_module_splits_train_val_and_test(tmp_path, quiet):
    write_cifar10(tmp_path)  # 5 x 6 train, 8 test
    dm = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=4, transform="pixels", val_fraction=0.2)
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (24, 6, 8)
    assert dm.dim == 3072 and dm.num_classes == 10 and dm.raw_images(True).shape == (30, 3, 32, 32)
    pixels = torch.from_numpy(_train_pixels()).float() / 255
    indices = np.concatenate([dm.train_dataset.indices, dm.val_dataset.indices])
    assert sorted(indices.tolist()) == list(range(30))  # a partition of the train split
    for dataset in (dm.train_dataset, dm.val_dataset):
        assert all(torch.equal(dataset[i][0], pixels[dataset.indices[i]]) for i in range(len(dataset)))
    test = torch.from_numpy(cifar_arrays(8, 0)[0]).float() / 255
    assert torch.equal(torch.stack([dm.test_dataset[i][0] for i in range(8)]), test)


def test_a_checksum_mismatch_only_warns_and_a_match_is_silent(tmp_path, monkeypatch):
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    with pytest.warns(RuntimeWarning, match=r"MD5 differs from the CIFAR-10 original: .*test_batch has") as record:
        load_cifar10(tmp_path, train=False)
    assert "torchvision lists 40351d587109b95175f43aff81a1287e" in str(record[0].message)
    actual = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    monkeypatch.setattr(cifar_module, "_expected_md5", lambda: actual)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        images, _ = load_cifar10(tmp_path, train=True)
    assert np.array_equal(images.reshape(30, -1), _train_pixels())


def test_missing_files_name_the_files_the_archive_the_url_and_the_folder(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_cifar10(tmp_path, train=True)
    message = str(err.value)
    assert DOWNLOADS == []  # download=False never tries
    assert all(name in message for name in BATCHES) and "test_batch" not in message
    assert "cifar-10-python.tar.gz" in message and "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in message
    assert str((tmp_path / "cifar-10-batches-py").resolve()) in message and "download" not in message
    with pytest.raises(DataNotFoundError) as err:
        load_cifar10(tmp_path, train=False, download=True)
    assert DOWNLOADS == [(str(tmp_path), False)]  # tried once, through torchvision, and refused
    assert "test_batch" in str(err.value) and "download failed: RuntimeError: network disabled" in str(err.value)


def test_prepare_data_offline_is_one_clear_error(tmp_path):
    dm = CIFAR10DataModule(data_dir=str(tmp_path))
    with pytest.raises(DataNotFoundError, match=r"data_batch_1, .*data_batch_5 not found in .*cifar-10-batches-py"):
        dm.prepare_data()
    assert DOWNLOADS == [(str(tmp_path), True)]


def test_an_unparseable_batch_is_corrupt_data_naming_the_file(tmp_path, quiet):
    write_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(b"not a pickle")
    with pytest.raises(CorruptDataError, match="data_batch_3 is not a CIFAR-10 batch file"):
        load_cifar10(tmp_path, train=True)
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(CorruptDataError, match=r"data_batch_3: data \(2, 100\).*expected \[N, 3072\]"):
        load_cifar10(tmp_path, train=True)
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}))
    with pytest.raises(CorruptDataError, match=r"data_batch_3: labels must be integers in 0..9"):
        load_cifar10(tmp_path, train=True)
    path.write_bytes(pickle.dumps({b"data": np.full((2, 3072), 256), b"labels": [0, 1]}))  # would wrap to 0
    with pytest.raises(CorruptDataError, match=r"data_batch_3: pixels must be integers in 0..255"):
        load_cifar10(tmp_path, train=True)


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return shutil.copyfile, (__file__, self.path)  # any callable a pickle names runs while loading


def test_a_pickle_that_names_other_code_is_refused_unrun(tmp_path, quiet):
    write_cifar10(tmp_path)
    marker = tmp_path / "ran"
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [_Payload(marker)]}))
    with pytest.raises(CorruptDataError, match=r"test_batch is not .*asks for shutil.copyfile"):
        load_cifar10(tmp_path, train=False)
    assert not marker.exists()


def test_a_damaged_archive_is_corrupt_data_naming_it(tmp_path):
    write_cifar10(tmp_path, archive=True)
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])  # some members whole, then EOF
    with pytest.raises(CorruptDataError, match="cifar-10-python.tar.gz cannot be extracted"):
        load_cifar10(tmp_path, train=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-python.tar.gz"]  # nothing half-extracted


def test_an_extraction_stopped_while_placing_files_places_none(tmp_path, monkeypatch):
    """The archive's files are placed together (files.staged): a failure at the third leaves no batch at all."""
    write_cifar10(tmp_path, archive=True)
    real, placed = os.replace, []

    def failing_replace(src, dst):
        if len(placed) == 2:
            raise OSError(28, "No space left on device")
        placed.append(dst)
        return real(src, dst)

    monkeypatch.setattr(cifar_module.os, "replace", failing_replace)
    with pytest.raises(CorruptDataError, match="cannot be extracted.*No space left"):
        load_cifar10(tmp_path, train=True)
    assert list((tmp_path / "cifar-10-batches-py").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-batches-py", "cifar-10-python.tar.gz"]
    monkeypatch.setattr(cifar_module.os, "replace", real)
    assert len(load_cifar10(tmp_path, train=True)[0]) > 0  # extracted whole on the next try


def test_the_lmdb_cache_serves_the_same_pixels_without_the_files(tmp_path, quiet):
    write_cifar10(tmp_path)
    dm = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=4, transform="pixels", use_lmdb=True)
    dm.prepare_data()
    assert (tmp_path / "cifar10_lmdb" / "train").is_dir() and (tmp_path / "cifar10_lmdb" / "test").is_dir()
    shutil.rmtree(tmp_path / "cifar-10-batches-py")  # from now on only the cache can serve the images
    dm.setup()
    pixels = torch.from_numpy(_train_pixels()).float() / 255
    assert all(torch.equal(dm.val_dataset[i][0], pixels[dm.val_dataset.indices[i]]) for i in range(3))
    assert torch.equal(dm.test_dataset[7][0], torch.from_numpy(cifar_arrays(8, 0)[0][7]).float() / 255)
    assert dm.test_dataset[7][1] == cifar_arrays(8, 0)[1][7]


def test_flips_mirror_the_noisy_item_along_the_width_in_training_only(tmp_path, quiet):
    write_cifar10(tmp_path, per_batch=20)  # 100 train images
    flipping, plain = (CIFAR10DataModule(data_dir=str(tmp_path), transform="logit_squeeze", random_flip=flip)
                       for flip in (True, False))
    flipping.setup()
    plain.setup()
    assert len(flipping.train_dataset) == 90
    items, coins = {}, {}
    for epoch in (0, 3):
        flipping.set_epoch(epoch)
        plain.set_epoch(epoch)
        items[epoch] = _images(flipping.train_dataset)
        ref = _images(plain.train_dataset)
        # same generator, the coin drawn after the noise: an item is the unflipped one (noise included) or its mirror
        same = (items[epoch] == ref).flatten(1).all(1)
        mirrored = (items[epoch] == torch.flip(ref, dims=[3])).flatten(1).all(1)
        assert (same ^ mirrored).all() and 30 <= int(mirrored.sum()) <= 60, int(mirrored.sum())  # of 90
        coins[epoch] = mirrored
    assert not torch.equal(coins[0], coins[3])  # other coins in another epoch
    flipping.set_epoch(0)
    assert torch.equal(_images(flipping.train_dataset), items[0])  # an epoch's flips come back (a resumed run)
    assert torch.equal(_images(flipping.val_dataset), _images(plain.val_dataset))  # never flipped
    assert torch.equal(_images(flipping.test_dataset), _images(plain.test_dataset))


def _images(dataset) -> torch.Tensor:
    return torch.stack([dataset[i][0] for i in range(len(dataset))]).view(len(dataset), 3, 32, 32)
