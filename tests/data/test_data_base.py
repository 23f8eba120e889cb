"""ImageDataModule as the extension point: a 'fifth dataset' added in a few lines over synthetic uint8 images."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest
import torch

from deqscore.data import ImageCodec, ImageDataModule, split_indices

LOADS: list[tuple[bool, bool]] = []  # (train, download) of every ToyDataModule.load_arrays call


def toy_arrays(train: bool) -> tuple[np.ndarray, np.ndarray]:
    n = 50 if train else 20
    images = np.random.default_rng(0 if train else 1).integers(0, 256, size=(n, 3, 4, 4), dtype=np.uint8)
    return images, np.arange(n) % 3


class ToyDataModule(ImageDataModule):
    """The whole of a new dataset: what it is called, its shapes, and where its arrays come from."""

    name = "toy"
    image_shape = (3, 4, 4)
    num_classes = 3

    def load_arrays(self, train: bool, *, download: bool) -> tuple[np.ndarray, np.ndarray]:
        LOADS.append((train, download))
        return toy_arrays(train)


@pytest.fixture(autouse=True)
def clear_loads():
    LOADS.clear()


def _toy(tmp_path, **kwargs) -> ToyDataModule:
    return ToyDataModule(data_dir=str(tmp_path), batch_size=8, **kwargs)


def test_class_attributes_and_codec(tmp_path):
    assert ToyDataModule.dim == 48
    dm = _toy(tmp_path)
    assert dm.transform == "logit_squeeze" and dm.bits_per_dim_exact
    assert dm.codec == ImageCodec("logit_squeeze", 1e-3, (3, 4, 4))
    assert not _toy(tmp_path, transform="logit").bits_per_dim_exact
    assert dm.lmdb_path(True) == tmp_path / "toy_lmdb" / "train"
    with pytest.raises(TypeError, match="abstract"):
        ImageDataModule()

    class Nameless(ToyDataModule):
        name = None  # what LightningDataModule itself defines

    with pytest.raises(TypeError, match="Nameless must set the class attribute"):
        Nameless()


def test_splits_shapes_and_pixels(tmp_path):
    dm = _toy(tmp_path, test_subset=12)
    dm.setup()
    assert LOADS == [(True, False), (False, False)]  # setup() never asks for a download
    train_idx, val_idx = split_indices(50, 0.1, 2019)
    assert len(train_idx) == 45 and len(val_idx) == 5
    assert np.array_equal(dm.train_dataset.indices, train_idx) and np.array_equal(dm.val_dataset.indices, val_idx)
    assert np.array_equal(dm.test_dataset.indices, np.arange(12))
    for dataset, train in ((dm.train_dataset, True), (dm.val_dataset, True), (dm.test_dataset, False)):
        images, labels = toy_arrays(train)
        x = torch.stack([dataset[i][0] for i in range(len(dataset))])
        assert x.shape == (len(dataset), 48) and x.dtype == torch.float32
        assert [dataset[i][1] for i in range(len(dataset))] == labels[dataset.indices].tolist()
        decoded = dm.to_images(x)
        assert decoded.shape == (len(dataset), 3, 4, 4)
        # the invertible pipeline brings every pixel back into its bin [k/256, (k+1)/256)
        offset = decoded.double() * 256 - torch.from_numpy(images[dataset.indices]).double()
        assert offset.min() >= -1e-3 and offset.max() <= 1 + 1e-3
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 48) and y.shape == (8,)


def test_train_noise_follows_the_epoch_and_val_noise_is_fixed(tmp_path):
    dm, other = _toy(tmp_path), _toy(tmp_path)
    dm.setup("fit")
    other.setup("fit")
    train0 = torch.stack([dm.train_dataset[i][0] for i in range(45)])
    val0 = torch.stack([dm.val_dataset[i][0] for i in range(5)])
    dm.set_epoch(1)
    train1 = torch.stack([dm.train_dataset[i][0] for i in range(45)])
    val1 = torch.stack([dm.val_dataset[i][0] for i in range(5)])
    assert (train0 != train1).float().mean() > 0.99  # fresh noise for (almost) every pixel
    assert torch.equal(val0, val1)
    assert torch.equal(val0, torch.stack([other.val_dataset[i][0] for i in range(5)]))
    dm.set_epoch(0)
    assert torch.equal(train0, torch.stack([dm.train_dataset[i][0] for i in range(45)]))


def _items(dataset, n: int) -> torch.Tensor:
    return torch.stack([dataset[i][0] for i in range(n)]).view(n, 3, 4, 4)


def test_random_flips_are_seeded_per_epoch_and_item_and_only_in_training(tmp_path):
    dm = _toy(tmp_path, transform="pixels", random_flip=True)
    dm.setup("fit")
    images = torch.from_numpy(toy_arrays(True)[0]).float() / 255
    plain = images[dm.train_dataset.indices]
    flipped = {}
    for epoch in (0, 1):
        dm.set_epoch(epoch)
        x = _items(dm.train_dataset, 45)
        is_flip = (x == plain.flip(-1)).flatten(1).all(1)
        # every item is the image or its mirror (pixels: no noise), about half of them mirrored
        assert ((x == plain).flatten(1).all(1) | is_flip).all() and 10 <= int(is_flip.sum()) <= 35
        flipped[epoch] = is_flip
    assert not torch.equal(flipped[0], flipped[1])  # other coins in another epoch
    dm.set_epoch(0)
    assert torch.equal((_items(dm.train_dataset, 45) == plain.flip(-1)).flatten(1).all(1), flipped[0])  # resumable
    val = _items(dm.val_dataset, 5)
    assert torch.equal(val, images[dm.val_dataset.indices])  # never flipped
    # without the option nothing is flipped
    no_flip = _toy(tmp_path, transform="pixels")
    no_flip.setup("fit")
    assert torch.equal(_items(no_flip.train_dataset, 45), plain)


def test_raw_images_are_the_split_before_pre_processing(tmp_path):
    dm = _toy(tmp_path)
    assert np.array_equal(dm.raw_images(True), toy_arrays(True)[0]) and dm.raw_images(False).shape == (20, 3, 4, 4)
    assert LOADS == [(True, False), (False, False)]  # never a download


def test_prepare_data_and_the_lmdb_cache(tmp_path):
    plain, cached = _toy(tmp_path), _toy(tmp_path, use_lmdb=True)
    plain.prepare_data()
    assert LOADS == [(True, True), (False, True)]  # prepare_data() may download
    LOADS.clear()
    cached.prepare_data()
    assert LOADS == [(True, True), (False, True)]  # ... also when it builds the caches
    LOADS.clear()
    cached.prepare_data()
    assert LOADS == []  # built once
    assert (tmp_path / "toy_lmdb" / "train" / "data.mdb").is_file()
    assert (tmp_path / "toy_lmdb" / "test" / "data.mdb").is_file()
    cached.setup()
    assert LOADS == []  # read from the cache
    plain.setup()
    for a, b in ((plain.val_dataset, cached.val_dataset), (plain.test_dataset, cached.test_dataset)):
        assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(len(a)))


def test_a_loader_that_breaks_the_class_attributes_fails_clearly(tmp_path):
    class Grey(ToyDataModule):  # claims one channel but loads three
        image_shape = (1, 4, 4)

    assert Grey.dim == 16
    with pytest.raises(ValueError, match=r"Grey.load_arrays must return uint8 images of 16 values each"):
        Grey(data_dir=str(tmp_path)).setup("fit")


def test_prepare_data_rebuilds_a_cache_with_a_damaged_item(tmp_path):
    cached = _toy(tmp_path, use_lmdb=True)
    cached.prepare_data()
    images, index = toy_arrays(True)[0], 7
    # one flipped bit in item 7's stored image (written through LMDB itself, so the page structure stays valid)
    with lmdb.open(str(tmp_path / "toy_lmdb" / "train"), subdir=True) as env, env.begin(write=True) as txn:
        record = bytearray(txn.get(b"7"))
        record[5] ^= 0x01
        txn.put(b"7", bytes(record))
    LOADS.clear()
    with pytest.warns(UserWarning, match="rebuilding"):
        cached.prepare_data()
    assert LOADS == [(True, True)]  # only the damaged split was loaded again
    cached.setup("fit")
    assert torch.equal(cached.train_dataset.base[index][0], torch.from_numpy(images[index]))
