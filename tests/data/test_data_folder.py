"""A folder of the user's own images as a data set: splits, resizing and cropping, channels from the files, and
one clear message for an empty folder, an unreadable file or mixed modes."""

import numpy as np
import pytest
from PIL import Image

from deqscore.data import CorruptDataError, DataNotFoundError, ImageData, ImageFolderDataModule


def _write(folder, n, size=(12, 8), mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
        path = folder / f"img{i:03d}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)
        paths.append(path)
    return paths


def test_images_are_resized_centre_cropped_and_split(tmp_path):
    _write(tmp_path / "cats", 6)
    _write(tmp_path / "dogs", 4, seed=1)
    dm = ImageFolderDataModule(data_dir=str(tmp_path), image_size=4, test_fraction=0.2, transform="pixels",
                               val_fraction=0.25, batch_size=2)
    assert isinstance(dm, ImageData) and dm.image_shape == (3, 4, 4) and dm.dim == 48
    train, test = dm.raw_images(True), dm.raw_images(False)
    assert train.shape == (8, 3, 4, 4) and test.shape == (2, 3, 4, 4)
    # by hand: a 12x8 image's shorter side to 4 (6x4, bilinear), then the centre 4x4 (columns 1..4)
    expected = []
    for path in sorted(tmp_path.rglob("img*")):
        with Image.open(path) as im:
            expected.append(np.asarray(im.resize((6, 4), Image.BILINEAR))[:, 1:5].transpose(2, 0, 1).tobytes())
    assert sorted(expected) == sorted(image.tobytes() for image in np.concatenate([train, test]))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))[0]
    assert batch.shape == (2, 48) and 0 <= float(batch.min()) and float(batch.max()) <= 1


def test_train_and_test_subfolders_are_the_splits_and_greyscale_has_one_channel(tmp_path):
    _write(tmp_path / "train", 5, mode="L")
    _write(tmp_path / "test", 3, mode="L", seed=2)
    dm = ImageFolderDataModule(data_dir=str(tmp_path), image_size=8, transform="pixels")
    assert dm.image_shape == (1, 8, 8)
    assert len(dm.raw_images(True)) == 5 and len(dm.raw_images(False)) == 3


def test_usage_errors_name_the_folder_or_the_file(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataNotFoundError, match="empty holds no image"):
        ImageFolderDataModule(data_dir=str(tmp_path / "empty"))
    with pytest.raises(DataNotFoundError, match="is not a folder"):
        ImageFolderDataModule(data_dir=str(tmp_path / "missing"))
    paths = _write(tmp_path / "broken", 4)
    paths[2].write_bytes(paths[2].read_bytes()[:40])  # truncated
    with pytest.raises(CorruptDataError, match=paths[2].name):
        ImageFolderDataModule(data_dir=str(tmp_path / "broken"), test_fraction=0.25).raw_images(True)
    _write(tmp_path / "mixed" / "a", 3)
    _write(tmp_path / "mixed" / "b", 3, mode="L")
    with pytest.raises(CorruptDataError, match="has image mode 'L'"):
        dm = ImageFolderDataModule(data_dir=str(tmp_path / "mixed"), test_fraction=0.2)
        dm.raw_images(True), dm.raw_images(False)


def test_skip_unreadable_leaves_bad_files_out_and_counts_them(tmp_path):
    paths = _write(tmp_path, 6)
    paths[3].write_bytes(b"not an image")
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        dm = ImageFolderDataModule(data_dir=str(tmp_path), test_fraction=0.2, skip_unreadable=True)
        n = len(dm.raw_images(True)) + len(dm.raw_images(False))
    assert n == 5


def test_the_cli_trains_an_ncsn_on_a_folder(tmp_path):
    from deqscore.cli.train import main

    _write(tmp_path / "images", 12, size=(10, 10))
    cli = main(["fit", "--config", "configs/ncsn/deq_mnist.yaml", "--data", "deqscore.data.ImageFolderDataModule",
                "--data.init_args.data_dir", str(tmp_path / "images"), "--data.init_args.image_size", "8",
                "--data.init_args.transform", "pixels", "--data.init_args.batch_size", "4",
                "--model.init_args.net.init_args.channels", "3", "--model.init_args.net.init_args.ngf", "4",
                "--model.init_args.n_levels", "3", "--model.init_args.sampler.init_args.n_steps_each", "2",
                "--trainer.fast_dev_run", "1", "--runs_root", str(tmp_path),
                "--run_name", "own", "--trainer.enable_progress_bar", "false"])
    assert cli.model.net.dim == 3 * 8 * 8
    assert cli.model.data_source["image_size"] == 8 and cli.model.data_source["data_dir"] == str(tmp_path / "images")


def test_the_lmdb_cache_holds_the_same_images(tmp_path):
    _write(tmp_path / "images", 10)
    plain = ImageFolderDataModule(data_dir=str(tmp_path / "images"), image_size=4, transform="pixels")
    cached = ImageFolderDataModule(data_dir=str(tmp_path / "images"), image_size=4, transform="pixels", use_lmdb=True)
    cached.prepare_data()
    assert cached.lmdb_path(True).is_dir() and ".deqscore_lmdb_4" in str(cached.lmdb_path(True))
    plain.setup("fit")
    cached.setup("fit")
    assert len(plain.train_dataset) == len(cached.train_dataset)
    for i in range(len(plain.train_dataset)):
        assert np.array_equal(plain.train_dataset[i][0].numpy(), cached.train_dataset[i][0].numpy())
    # the cache inside the folder is not read as images
    assert len(ImageFolderDataModule(data_dir=str(tmp_path / "images"), image_size=4)._splits[True]) == 9


def test_sample_fid_rebuilds_the_folder_data_of_the_checkpoint(tmp_path, monkeypatch):
    import json

    import sample
    from deqscore.cli.train import main

    _write(tmp_path / "images", 12, size=(10, 10))
    main(["fit", "--config", "configs/ncsn/explicit_mnist.yaml", "--data", "deqscore.data.ImageFolderDataModule",
          "--data.init_args.data_dir", str(tmp_path / "images"), "--data.init_args.image_size", "8",
          "--data.init_args.transform", "pixels", "--data.init_args.batch_size", "4",
          "--model.init_args.net.init_args.channels", "3", "--model.init_args.net.init_args.ngf", "4",
          "--model.init_args.n_levels", "3", "--model.init_args.sampler.init_args.n_steps_each", "1",
          "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--runs_root", str(tmp_path),
          "--run_name", "own", "--trainer.enable_progress_bar", "false"])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    code = sample.main(["--checkpoint", str(tmp_path / "own" / "checkpoints" / "last.ckpt"), "--num-samples", "4",
                        "--out", str(tmp_path / "s"), "--fid", "--stats-root", str(tmp_path / "stats")])
    assert code == 0
    report = json.loads((tmp_path / "s" / "fid.json").read_text())
    assert report["num_samples"] == 4 and report["reference"].endswith("train (11 images)")  # the folder's split
    assert list((tmp_path / "stats").glob("folder-images-*_train_8x8_n11.npz"))
