"""CelebA 64x64 from torchvision's folder layout: NCSNv2's crop and resize, channel order, partitions, the decoded
``.npy`` cache, LMDB and flips, offline and corrupt-file errors."""

import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

from deqscore.data import CelebADataModule, CorruptDataError, DataNotFoundError
from deqscore.data import celeba as celeba_module
from deqscore.data.celeba import load_celeba64
from tests.data.fake_images import write_celeba

DOWNLOADS: list[tuple] = []  # the (root, split) of every attempted torchvision download


@pytest.fixture(autouse=True)
def no_celeba_download(monkeypatch):
    """torchvision's CelebA (the only downloader) records the attempt and fails; urlopen fails too."""
    import torchvision.datasets

    def refuse(root, split="train", download=False, **kwargs):
        DOWNLOADS.append((root, split))
        raise RuntimeError("network disabled in tests")

    def no_network(*args, **kwargs):
        raise AssertionError("a test touched the network")

    DOWNLOADS.clear()
    monkeypatch.setattr(torchvision.datasets, "CelebA", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", no_network)


@pytest.fixture
def decodes(monkeypatch) -> list[str]:
    """The names of the JPEGs decoded, in order."""
    calls, real = [], celeba_module.crop_resize

    def counting(path):
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(celeba_module, "crop_resize", counting)
    return calls


def _images_dir(root):
    return root / "celeba" / "img_align_celeba"


def _ncsnv2(path) -> np.ndarray:
    """NCSNv2's own pipeline: torchvision's CenterCrop(140) then Resize(64) on the PIL image, as uint8 CHW."""
    with Image.open(path) as image:
        small = transforms.Compose([transforms.CenterCrop(140), transforms.Resize(64)])(image.convert("RGB"))
    return np.array(small).transpose(2, 0, 1)  # a writable copy (torch.from_numpy warns on PIL's read-only view)


def _pil(path) -> np.ndarray:
    """The same written out with PIL: the crop box at torchvision's offsets, then a bilinear resize."""
    with Image.open(path) as image:
        assert image.size == (178, 218)
        box = (19, 39, 19 + 140, 39 + 140)  # round((178 - 140) / 2), round((218 - 140) / 2)
        return np.asarray(image.convert("RGB").crop(box).resize((64, 64), Image.BILINEAR)).transpose(2, 0, 1)


def test_crop_and_resize_are_ncsnv2s(tmp_path):
    write_celeba(tmp_path)
    images, labels = load_celeba64(tmp_path, train=True)
    assert images.shape == (10, 3, 64, 64) and images.dtype == np.uint8 and labels.tolist() == [0] * 10
    for i in range(10):
        path = _images_dir(tmp_path) / f"{i + 1:06d}.jpg"
        assert np.array_equal(images[i], _ncsnv2(path)) and np.array_equal(images[i], _pil(path))


def test_partitions_zero_and_two_are_train_and_test(tmp_path):
    write_celeba(tmp_path)  # partitions: 1-10 train, 11-12 valid, 13-16 test
    test, labels = load_celeba64(tmp_path, train=False)
    assert test.shape == (4, 3, 64, 64) and not labels.any()
    expected = [_ncsnv2(_images_dir(tmp_path) / f"{i:06d}.jpg") for i in range(13, 17)]
    assert np.array_equal(test, np.stack(expected))


def test_items_are_rgb_planes_over_255(tmp_path):
    write_celeba(tmp_path, partitions=(0, 0, 2))
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    for i, colour in enumerate(colours, 1):  # flat colours survive JPEG, crop and resize almost unchanged
        Image.new("RGB", (178, 218), colour).save(_images_dir(tmp_path) / f"{i:06d}.jpg", quality=95)
    dm = CelebADataModule(data_dir=str(tmp_path), transform="pixels", val_fraction=0.0, batch_size=1)
    dm.setup()
    items = [dm.train_dataset[j][0] for j in range(2)] + [dm.test_dataset[0][0]]
    order = [int(dm.train_dataset.indices[j]) for j in range(2)] + [2]
    for x, i in zip(items, order, strict=True):
        image = x.view(3, 64, 64)
        assert (image[i] > 0.97).all() and (image[[c for c in range(3) if c != i]] < 0.03).all()  # channel i lit
        assert torch.equal(image, torch.from_numpy(_ncsnv2(_images_dir(tmp_path) / f"{i + 1:06d}.jpg")) / 255)


def test_the_decoded_cache_is_used_on_the_second_setup(tmp_path, decodes):
    write_celeba(tmp_path)
    first = CelebADataModule(data_dir=str(tmp_path), transform="pixels")
    first.setup()
    assert len(decodes) == 14  # 10 train + 4 test, each once
    folder = tmp_path / "celeba"
    cache = np.load(folder / "celeba64_train.npy")
    assert cache.shape == (10, 3, 64, 64) and np.array_equal(cache, first.raw_images(True))
    assert sorted(p.name for p in folder.iterdir()) == [  # written atomically: no scratch file left
        "celeba64_test.npy", "celeba64_train.npy", "img_align_celeba", "list_eval_partition.txt"]
    for path in _images_dir(tmp_path).iterdir():  # the JPEGs are no longer needed
        path.unlink()
    _images_dir(tmp_path).rmdir()
    second = CelebADataModule(data_dir=str(tmp_path), transform="pixels")
    second.prepare_data()
    second.setup()
    assert len(decodes) == 14 and DOWNLOADS == []  # nothing decoded again, nothing fetched
    assert second.train_dataset.base.images.numpy().flags.writeable  # a copy-on-write map: no torch warning
    for a, b in ((first.val_dataset, second.val_dataset), (first.test_dataset, second.test_dataset)):
        assert all(torch.equal(a[i][0], b[i][0]) for i in range(len(a)))


def test_a_cache_of_another_size_is_decoded_again(tmp_path, decodes):
    write_celeba(tmp_path)
    np.save(tmp_path / "celeba" / "celeba64_train.npy", np.zeros((3, 3, 64, 64), np.uint8))
    images, _ = load_celeba64(tmp_path, train=True)
    assert len(decodes) == 10 and np.array_equal(images[0], _ncsnv2(_images_dir(tmp_path) / "000001.jpg"))
    assert np.load(tmp_path / "celeba" / "celeba64_train.npy").shape == (10, 3, 64, 64)  # replaced


def test_lmdb_cache_and_flips(tmp_path):
    write_celeba(tmp_path)
    dm = CelebADataModule(data_dir=str(tmp_path), batch_size=2, transform="pixels", use_lmdb=True, val_fraction=0.2,
                          random_flip=True)
    dm.prepare_data()
    assert DOWNLOADS == []  # the files are there: nothing fetched
    assert (tmp_path / "celeba_lmdb" / "train").is_dir() and (tmp_path / "celeba_lmdb" / "test").is_dir()
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (8, 2, 4)
    direct = {i: torch.from_numpy(_ncsnv2(_images_dir(tmp_path) / f"{i + 1:06d}.jpg")) / 255 for i in range(10)}
    for j in range(2):  # validation: never flipped
        assert torch.equal(dm.val_dataset[j][0].view(3, 64, 64), direct[int(dm.val_dataset.indices[j])])
    coins = {}
    for epoch in range(5):
        dm.set_epoch(epoch)
        coins[epoch] = []
        for j in range(8):
            x, image = dm.train_dataset[j][0].view(3, 64, 64), direct[int(dm.train_dataset.indices[j])]
            assert torch.equal(x, image) or torch.equal(x, torch.flip(image, dims=[2]))  # mirrored along the width
            coins[epoch].append(torch.equal(x, torch.flip(image, dims=[2])))
    assert 10 <= sum(map(sum, coins.values())) <= 30  # of 40 coins
    dm.set_epoch(2)
    assert [torch.equal(dm.train_dataset[j][0], dm.train_dataset[j][0]) for j in range(8)] == [True] * 8
    assert [not torch.equal(dm.train_dataset[j][0].view(3, 64, 64), direct[int(dm.train_dataset.indices[j])])
            for j in range(8)] == coins[2]  # an epoch's flips come back


def test_missing_files_name_what_to_put_where(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_celeba64(tmp_path, train=True)
    message = str(err.value)
    folder = (tmp_path / "celeba").resolve()
    assert "img_align_celeba" in message and "list_eval_partition.txt" in message and str(folder) in message
    assert DOWNLOADS == [] and "download" not in message
    with pytest.raises(DataNotFoundError, match="download failed: RuntimeError: network disabled") as err:
        CelebADataModule(data_dir=str(tmp_path)).prepare_data()
    assert DOWNLOADS == [(str(tmp_path), "all")]  # tried through torchvision, refused; the first split fails
    assert str(folder / "img_align_celeba") in str(err.value)


def test_a_missing_image_is_named_before_any_decoding(tmp_path, decodes):
    write_celeba(tmp_path)
    (_images_dir(tmp_path) / "000007.jpg").unlink()
    with pytest.raises(DataNotFoundError, match=r"1 CelebA image\(s\) listed in list_eval_partition.txt .*000007.jpg"):
        load_celeba64(tmp_path, train=True)
    assert decodes == []
    (_images_dir(tmp_path)).rename(tmp_path / "elsewhere")
    with pytest.raises(DataNotFoundError, match="put list_eval_partition.txt there and the aligned images"):
        load_celeba64(tmp_path, train=True)


def test_a_broken_image_or_partition_file_is_corrupt_data_naming_it(tmp_path):
    write_celeba(tmp_path)
    (_images_dir(tmp_path) / "000002.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(CorruptDataError, match="000002.jpg is not a readable image"):
        load_celeba64(tmp_path, train=True)
    path = _images_dir(tmp_path) / "000014.jpg"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a real JPEG, cut short
    with pytest.raises(CorruptDataError, match="000014.jpg is not a readable image"):
        load_celeba64(tmp_path, train=False)
    assert not list((tmp_path / "celeba").glob("*.npy"))  # nothing cached from a failed decode
    (tmp_path / "celeba" / "list_eval_partition.txt").write_text("000001.jpg 0\n000002.jpg zero\n")
    with pytest.raises(CorruptDataError, match="list_eval_partition.txt, line 2"):
        load_celeba64(tmp_path, train=True)
