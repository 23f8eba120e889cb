"""CelebA 64x64 from torchvision's folder layout: the NCSNv2 crop and resize, partitions, the decoded cache,
LMDB, offline and corrupt-file errors."""

import numpy as np
import pytest
from PIL import Image

from deqscore.data import CelebADataModule, CorruptDataError, DataNotFoundError
from deqscore.data import celeba as celeba_module
from deqscore.data.celeba import load_celeba64
from tests.data.fake_images import write_celeba


@pytest.fixture(autouse=True)
def no_celeba_download(monkeypatch):
    import torchvision.datasets

    def refuse(*args, **kwargs):
        raise RuntimeError("network disabled in tests")

    monkeypatch.setattr(torchvision.datasets, "CelebA", refuse)


def _direct(path):
    """torchvision's CenterCrop(140) then Resize(64), written out with PIL."""
    with Image.open(path) as image:
        w, h = image.size
        left, top = int(round((w - 140) / 2.0)), int(round((h - 140) / 2.0))
        small = image.convert("RGB").crop((left, top, left + 140, top + 140)).resize((64, 64), Image.BILINEAR)
    return np.asarray(small).transpose(2, 0, 1)


def test_partitions_crop_resize_and_the_decoded_cache(tmp_path, monkeypatch):
    write_celeba(tmp_path)
    images, labels = load_celeba64(tmp_path, train=True)
    assert images.shape == (10, 3, 64, 64) and images.dtype == np.uint8 and not labels.any()
    folder = tmp_path / "celeba" / "img_align_celeba"
    assert np.array_equal(images[3], _direct(folder / "000004.jpg"))
    test, _ = load_celeba64(tmp_path, train=False)  # partition 2: images 13-16 (11, 12 are partition 1)
    assert test.shape == (4, 3, 64, 64) and np.array_equal(test[0], _direct(folder / "000013.jpg"))
    assert (tmp_path / "celeba" / "celeba64_train.npy").is_file()
    monkeypatch.setattr(celeba_module, "crop_resize", lambda path: pytest.fail("decoded again"))
    again, _ = load_celeba64(tmp_path, train=True)  # from the cache
    assert np.array_equal(again, images)


def test_a_cache_of_another_size_is_decoded_again(tmp_path):
    write_celeba(tmp_path)
    np.save(tmp_path / "celeba" / "celeba64_train.npy", np.zeros((3, 3, 64, 64), np.uint8))
    images, _ = load_celeba64(tmp_path, train=True)
    assert images.shape[0] == 10 and images.any()


def test_data_module_with_lmdb_and_flips(tmp_path):
    write_celeba(tmp_path)
    dm = CelebADataModule(data_dir=str(tmp_path), batch_size=2, transform="pixels", use_lmdb=True, val_fraction=0.2,
                          random_flip=True)
    dm.prepare_data()
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (8, 2, 4)
    assert (tmp_path / "celeba_lmdb" / "train").is_dir()
    raw = dm.raw_images(True)
    x, _ = dm.val_dataset[1]
    assert np.array_equal((x.view(3, 64, 64).numpy() * 255).round().astype(np.uint8), raw[dm.val_dataset.indices[1]])


def test_missing_files_name_what_to_put_where(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_celeba64(tmp_path, train=True, download=True)
    message = str(err.value)
    assert "img_align_celeba" in message and "list_eval_partition.txt" in message and str(tmp_path) in message


def test_a_broken_image_or_partition_file_is_corrupt_data_naming_it(tmp_path):
    write_celeba(tmp_path)
    (tmp_path / "celeba" / "img_align_celeba" / "000002.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(CorruptDataError, match="000002.jpg"):
        load_celeba64(tmp_path, train=True)
    (tmp_path / "celeba" / "list_eval_partition.txt").write_text("000001.jpg zero\n")
    with pytest.raises(CorruptDataError, match="line 1"):
        load_celeba64(tmp_path, train=True)
