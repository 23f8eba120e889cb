"""UCIDataModule: reading and checking the UCI files, the DKEF pre-processing, the synthetic Gaussian and the
loaders. The real files are the ones shipped in ``datasets/uci`` (checked against their SHA-256); the network is
never touched (``uci_files._open_url`` is replaced in every test)."""

from __future__ import annotations

import hashlib
import io
import math
import shutil
import urllib.error
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from deqscore.data import UCIDataModule, uci_files
from deqscore.data import uci as uci_module
from deqscore.data.datasets import EpochShuffleSampler
from deqscore.data.errors import CorruptDataError, DataNotFoundError
from deqscore.data.uci import UCI_FILES, dequantize_columns, median_gaps, prune_correlated, split_sizes
from deqscore.errors import ConfigError

UCI_DATA = Path(__file__).resolve().parents[2] / "datasets" / "uci"  # shipped
RED, WHITE, PARKINSONS = (UCI_FILES[name].name for name in ("redwine", "whitewine", "parkinsons"))
# Parkinsons columns left by the two pruning rules (from the file's header, columns 3 onward)
REFERENCE_COLUMNS = [
    "test_time", "motor_UPDRS", "total_UPDRS", "Jitter(Abs)", "Jitter:PPQ5", "Jitter:DDP", "Shimmer(dB)",
    "Shimmer:APQ5", "Shimmer:APQ11", "Shimmer:DDA", "NHR", "HNR", "RPDE", "DFA", "PPE",
]  # fmt: skip
GREEDY_COLUMNS = [
    "test_time", "motor_UPDRS", "total_UPDRS", "Jitter(%)", "Jitter(Abs)", "Jitter:PPQ5", "Shimmer",
    "Shimmer:APQ3", "Shimmer:APQ11", "NHR", "HNR", "RPDE", "DFA", "PPE",
]  # fmt: skip


@pytest.fixture(autouse=True)
def no_uci_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every URL open fails at once (as offline); returns the URLs that were tried."""
    calls: list[str] = []

    def offline(url, timeout):
        calls.append(url)
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(uci_files, "_open_url", offline)
    return calls


@pytest.fixture(scope="session")
def uci_root() -> Path:
    return UCI_DATA


@pytest.mark.parametrize("dataset", ["redwine", "whitewine", "parkinsons"])
def test_shipped_files_match_their_checksums(dataset):
    """The files in ``datasets/uci`` are the original UCI bytes: the SHA-256 the loader checks downloads against,
    and the one the folder's README states."""
    spec = UCI_FILES[dataset]
    assert hashlib.sha256((UCI_DATA / spec.name).read_bytes()).hexdigest() == spec.sha256
    readme = (UCI_DATA / "README.md").read_text()
    assert f"`{spec.name}`" in readme and spec.sha256 in readme


def test_the_default_root_is_the_shipped_folder():
    """A plain ``UCIDataModule()`` run from the repository root reads the shipped files, with no download."""
    assert (Path(__file__).resolve().parents[2] / UCIDataModule().root).resolve() == UCI_DATA.resolve()


def _raw(root: Path, name: str, delimiter: str) -> np.ndarray:
    return np.loadtxt(root / name, delimiter=delimiter, skiprows=1)


def _setup(**kwargs) -> UCIDataModule:
    dm = UCIDataModule(**kwargs)
    dm.setup("fit")
    return dm


def _all_rows(dm: UCIDataModule) -> torch.Tensor:
    return torch.cat([dm.train_data, dm.val_data, dm.test_data])


# -- shapes and splits -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "n_rows", "dim", "sizes"),
    [
        ("redwine", 1599, 11, (1296, 144, 159)),
        ("whitewine", 4898, 11, (3969, 440, 489)),
        ("parkinsons", 5875, 15, (4760, 528, 587)),
    ],
)
def test_shapes_and_split_sizes(uci_root, dataset, n_rows, dim, sizes):
    test = min(1000, n_rows // 10)
    val = min(1000, (n_rows - test) // 10)
    assert split_sizes(n_rows) == (n_rows - val - test, val, test) == sizes
    dm = _setup(dataset=dataset, root=str(uci_root))
    assert dm.dim == dim
    for data, n in zip((dm.train_data, dm.val_data, dm.test_data), sizes, strict=True):
        assert data.shape == (n, dim) and data.dtype == torch.float32
    rows = np.concatenate([dm.split_rows["train"], dm.split_rows["val"], dm.split_rows["test"]])
    assert np.array_equal(np.sort(rows), np.arange(n_rows))  # every file row in exactly one split
    assert dm.codec is None and dm.true_log_prob(dm.test_data) is None and dm.true_score(dm.test_data) is None


def test_split_sizes_cap_held_out_sets_at_1000():
    assert split_sizes(100_000) == (98_000, 1000, 1000)
    assert split_sizes(10) == (9, 0, 1)  # (10 - 1) // 10 = 0 val rows


def test_dim_is_known_before_setup(uci_root, tmp_path, no_uci_network):
    assert UCIDataModule("parkinsons", root=str(uci_root)).dim == 15
    assert UCIDataModule("parkinsons", root=str(uci_root), prune_rule="greedy").dim == 14
    assert UCIDataModule("redwine", root=str(uci_root)).dim == 11
    assert UCIDataModule("highdim", dim=7).dim == 7
    # before prepare_data() (LightningCLI links dim to the model at instantiation): the original file's dim
    for rule, dim in (("reference", 15), ("greedy", 14)):
        assert UCIDataModule("parkinsons", root=str(tmp_path), prune_rule=rule).dim == dim
    assert UCIDataModule("whitewine", root=str(tmp_path)).dim == 11
    assert no_uci_network == [] and list(tmp_path.iterdir()) == []


def test_parkinsons_file_with_another_dim_than_stated_fails_setup(uci_root, tmp_path, monkeypatch):
    header, *lines = (uci_root / PARKINSONS).read_text().splitlines()
    names = header.split(",")
    raw = _raw(uci_root, PARKINSONS, ",")
    raw[:, names.index("Shimmer:DDA")] = np.random.RandomState(0).uniform(0.01, 0.1, len(raw))
    assert len(prune_correlated(raw[:, 3:])) != 15  # precondition: this copy prunes to another dim
    body = "\n".join(",".join(repr(float(v)) for v in row) for row in raw)

    def serve(url, timeout):
        return io.BytesIO(f"{header}\n{body}\n".encode())

    monkeypatch.setattr(uci_files, "_open_url", serve)
    dm = UCIDataModule("parkinsons", root=str(tmp_path))
    assert dm.dim == 15  # stated before the file is there
    dm.prepare_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # another checksum
        with pytest.raises(CorruptDataError, match="dim=15"):
            dm.setup()


# -- whitening and noise -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["redwine", "whitewine", "parkinsons"])
@pytest.mark.parametrize("whiten_on", ["all", "train"])
def test_whitening_gives_identity_covariance_on_the_fitting_set(uci_root, dataset, whiten_on):
    dm = _setup(dataset=dataset, root=str(uci_root), noise_std=0.0, whiten_on=whiten_on)
    fitted = (_all_rows(dm) if whiten_on == "all" else dm.train_data).double().numpy()
    assert np.abs(fitted.mean(axis=0)).max() < 1e-6
    assert np.abs(np.cov(fitted, rowvar=False, bias=True) - np.eye(dm.dim)).max() < 1e-6
    if whiten_on == "train":  # the held-out rows were not part of the fit: the whole set is not white
        everything = _all_rows(dm).double().numpy()
        assert np.abs(np.cov(everything, rowvar=False, bias=True) - np.eye(dm.dim)).max() > 1e-3


def test_noise_is_gaussian_and_added_once_to_every_split(uci_root):
    clean = _setup(dataset="redwine", root=str(uci_root), noise_std=0.0)
    noisy = _setup(dataset="redwine", root=str(uci_root), noise_std=0.05)
    noise = (_all_rows(noisy) - _all_rows(clean)).double()
    assert noise.std().item() == pytest.approx(0.05, rel=0.03)
    assert abs(noise.mean().item()) < 0.002
    for name in ("train", "val", "test"):
        diff = getattr(noisy, f"{name}_data") - getattr(clean, f"{name}_data")
        assert diff.abs().min() > 0 or diff.std() > 0.04
    # the noise is drawn once: the splits do not change between setup() calls or loader passes
    x1 = torch.cat([b[0] for b in noisy.val_dataloader()])
    noisy.setup("validate")
    x2 = torch.cat([b[0] for b in noisy.val_dataloader()])
    assert torch.equal(x1, x2) and torch.equal(x1, noisy.val_data)


def test_whitening_maps_the_file_rows_back(uci_root):
    """``x = (row - mean) @ M`` exactly (up to float32) for Parkinsons, which is not dequantised."""
    dm = _setup(dataset="parkinsons", root=str(uci_root), noise_std=0.0)
    raw = _raw(uci_root, PARKINSONS, ",")[:, 3:]
    header = (uci_root / PARKINSONS).read_text().splitlines()[0].split(",")[3:]
    kept = [header.index(name) for name in dm.source_columns]
    rows = raw[dm.split_rows["test"]][:, kept]
    back = dm.test_data.double().numpy() @ np.linalg.inv(dm.whiten_matrix) + dm.whiten_mean
    assert np.allclose(back, rows, rtol=1e-5, atol=1e-6 * np.abs(raw).max(axis=0)[kept])
    # the whitening's own inverse (what sample.py writes samples through) does the same, on tensors too
    assert np.allclose(dm.whitening.to_data(dm.test_data.double()).numpy(), rows, rtol=1e-5,
                       atol=1e-6 * np.abs(raw).max(axis=0)[kept])
    assert np.allclose(dm.whitening.to_model(rows), dm.test_data.double().numpy(), atol=1e-5)
    assert dm.whitening.columns == tuple(dm.source_columns)


def test_a_dimension_is_only_taken_by_the_synthetic_data(uci_root):
    with pytest.raises(ConfigError, match="dim: only the synthetic data set 'highdim' takes a dimension; 'redwine'"):
        UCIDataModule("redwine", root=str(uci_root), dim=11)
    assert UCIDataModule("highdim").dim == 200 and UCIDataModule("redwine", root=str(uci_root)).dim == 11


# -- Parkinsons column pruning -----------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "expected"), [("reference", REFERENCE_COLUMNS), ("greedy", GREEDY_COLUMNS)])
def test_parkinsons_column_pruning(uci_root, rule, expected):
    dm = _setup(dataset="parkinsons", root=str(uci_root), prune_rule=rule)
    assert dm.source_columns == expected and dm.dim == len(expected)
    header = (uci_root / PARKINSONS).read_text().splitlines()[0].split(",")
    assert header[:3] == ["subject#", "age", "sex"]
    header, raw = header[3:], _raw(uci_root, PARKINSONS, ",")[:, 3:]
    corr = np.abs(np.corrcoef(raw, rowvar=False))
    kept = [header.index(name) for name in expected]
    pairs = corr[np.ix_(kept, kept)] - np.eye(len(kept))
    assert pairs.max() <= 0.98  # no kept pair is correlated above the threshold
    for j in set(range(len(header))) - set(kept):  # and nothing was dropped without reason
        partners = [k for k in kept if corr[j, k] > 0.98 and (rule == "reference" or k < j)]
        assert partners, f"{header[j]} was dropped but has no kept partner above 0.98"


def test_prune_correlated_rules_and_negative_correlation():
    rng = np.random.RandomState(0)
    a, b, c = rng.standard_normal((3, 500))
    data = np.stack([a, b, -a + 1e-3 * c, c], axis=1)  # column 2 is anti-correlated with column 0
    assert prune_correlated(data, 0.98, "greedy").tolist() == [0, 1, 3]  # keeps the earlier one
    assert prune_correlated(data, 0.98, "reference").tolist() == [1, 2, 3]  # drops the first offender
    assert prune_correlated(data[:, [0, 1, 3]], 0.98).tolist() == [0, 1, 2]  # nothing to prune


# -- wine dequantisation -----------------------------------------------------------------------------------


def test_dequantize_columns_stays_within_half_the_median_gap():
    data = np.repeat(np.array([[0.0, 10.0], [0.5, 20.0], [1.0, 30.0], [2.0, 50.0], [2.0, 50.0]]), 200, axis=0)
    gaps = median_gaps(data)
    assert gaps.tolist() == [0.5, 10.0]  # sorted distinct values have gaps (0.5, 0.5, 1) and (10, 10, 20)
    noisy = dequantize_columns(data, np.random.RandomState(1))
    diff = noisy - data
    assert np.all(np.abs(diff) <= gaps / 2) and np.all(np.abs(diff).max(axis=0) > 0.45 * gaps)
    assert median_gaps(np.ones((5, 1))).tolist() == [0.0]


@pytest.mark.parametrize(("dataset", "name"), [("redwine", RED), ("whitewine", WHITE)])
def test_wine_dequantisation_keeps_each_value_in_its_bin(uci_root, dataset, name):
    dm = _setup(dataset=dataset, root=str(uci_root), noise_std=0.0)
    raw = _raw(uci_root, name, ";")[:, :11]
    gaps = np.array([np.median(np.diff(np.unique(col))) for col in raw.T])
    x = _all_rows(dm).double().numpy()
    rows = np.concatenate([dm.split_rows[s] for s in ("train", "val", "test")])
    dequantised = x @ np.linalg.inv(dm.whiten_matrix) + dm.whiten_mean
    noise = dequantised - raw[rows]
    assert np.all(np.abs(noise) <= gaps / 2 * (1 + 1e-4))  # within half the median gap (float32 slack)
    assert np.all(np.abs(noise).max(axis=0) > 0.45 * gaps)  # and the noise fills the bin
    assert np.all(np.abs(noise.mean(axis=0)) < 0.05 * gaps)  # centred


# -- determinism -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["redwine", "parkinsons", "highdim"])
def test_determinism_under_the_seed(uci_root, dataset):
    kwargs = {"dataset": dataset, "root": str(uci_root)} | ({"dim": 5} if dataset == "highdim" else {})
    a, b, c = _setup(**kwargs), _setup(**kwargs), _setup(seed=7, **kwargs)
    for name in ("train_data", "val_data", "test_data"):
        assert torch.equal(getattr(a, name), getattr(b, name))
        assert not torch.equal(getattr(a, name), getattr(c, name))
    order_a = torch.cat([x for (x,) in a.train_dataloader()])
    order_b = torch.cat([x for (x,) in b.train_dataloader()])
    assert torch.equal(order_a, order_b)


# -- file checks -------------------------------------------------------------------------------------------


def test_original_files_load_without_warnings(uci_root):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dataset in ("redwine", "whitewine", "parkinsons"):
            _setup(dataset=dataset, root=str(uci_root))


def test_checksum_mismatch_warns_but_loads(uci_root, tmp_path):
    lines = (uci_root / RED).read_text().splitlines(keepends=True)
    assert lines[1].startswith("7.4;")
    lines[1] = "7.5" + lines[1][3:]  # one digit changed: still a valid file
    copy = tmp_path / RED
    copy.write_text("".join(lines))
    found = hashlib.sha256(copy.read_bytes()).hexdigest()
    dm = UCIDataModule("redwine", root=str(tmp_path))
    with pytest.warns(UserWarning, match=RED) as record:
        dm.setup()
    message = str(record[0].message)
    assert UCI_FILES["redwine"].sha256 in message and found in message
    assert dm.train_data.shape == (1296, 11)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda lines: lines[:5] + ["7.4;0.7;0;1.9;abc;11;34;0.9978;3.51;0.56;9.4;5\n"] + lines[5:], "abc"),
        (lambda lines: lines[:5] + ["7.4;0.7;0;1.9;0.076;11;34;0.9978;3.51;0.56;9.4\n"] + lines[5:], "11 columns"),
        (lambda lines: lines[:5] + ["7.4;0.7;0;1.9;;11;34;0.9978;3.51;0.56;9.4;5\n"] + lines[5:], "line 6"),
        (lambda lines: [line.replace(";", ",") for line in lines], "1 columns"),
        (lambda lines: lines[:1], "no data rows"),
        (lambda lines: [], "empty"),
    ],
    ids=["non-numeric", "short-row", "missing-value", "wrong-separator", "header-only", "empty"],
)
def test_corrupt_file_raises_naming_it(uci_root, tmp_path, edit, problem):
    lines = (uci_root / RED).read_text().splitlines(keepends=True)
    (tmp_path / RED).write_text("".join(edit(lines)))
    dm = UCIDataModule("redwine", root=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the checksum differs, of course
        with pytest.raises(CorruptDataError, match=RED) as info:
            dm.setup()
    assert problem in str(info.value) and str(tmp_path) in str(info.value)


def test_binary_file_raises_corrupt(tmp_path):
    (tmp_path / PARKINSONS).write_bytes(b"\xff\xfe\x00garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CorruptDataError, match=PARKINSONS):
            UCIDataModule("parkinsons", root=str(tmp_path)).setup()


# -- missing files and downloads ---------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["redwine", "whitewine", "parkinsons"])
def test_missing_file_offline_names_file_and_folder(tmp_path, no_uci_network, dataset):
    root = tmp_path / "uci"
    spec = UCI_FILES[dataset]
    dm = UCIDataModule(dataset, root=str(root))
    with pytest.raises(DataNotFoundError) as info:
        dm.setup()  # setup never downloads
    assert no_uci_network == []
    assert spec.name in str(info.value) and str(root.resolve()) in str(info.value)
    with pytest.raises(DataNotFoundError) as info:
        dm.prepare_data()
    message = str(info.value)
    assert no_uci_network == [spec.url]
    assert spec.name in message and str(root.resolve()) in message and spec.url in message
    assert "URLError" in message
    assert not root.exists() or list(root.iterdir()) == []  # nothing half-written


def test_prepare_data_downloads_into_root(uci_root, tmp_path, monkeypatch):
    urls: list[str] = []

    def serve(url, timeout):
        urls.append(url)
        return io.BytesIO((uci_root / RED).read_bytes())

    monkeypatch.setattr(uci_files, "_open_url", serve)
    root = tmp_path / "nested" / "uci"
    dm = UCIDataModule("redwine", root=str(root))
    dm.prepare_data()
    assert urls == [UCI_FILES["redwine"].url]
    assert sorted(p.name for p in root.iterdir()) == [RED]  # the temporary file was renamed
    assert (root / RED).read_bytes() == (uci_root / RED).read_bytes()
    dm.prepare_data()  # present now: not downloaded again
    assert len(urls) == 1
    dm.setup()
    assert dm.train_data.shape == (1296, 11)


def test_interrupted_download_leaves_nothing(uci_root, tmp_path, monkeypatch):
    class Broken(io.BytesIO):
        def read(self, size=-1):
            if self.tell() > 0:
                raise ConnectionResetError("connection reset mid-file")
            return super().read(1000)

    monkeypatch.setattr(uci_files, "_open_url", lambda url, timeout: Broken((uci_root / RED).read_bytes()))
    with pytest.raises(DataNotFoundError, match="ConnectionResetError"):
        UCIDataModule("redwine", root=str(tmp_path)).prepare_data()
    assert list(tmp_path.iterdir()) == []


def test_prepare_data_uses_files_already_there(uci_root, no_uci_network):
    for dataset in ("redwine", "whitewine", "parkinsons", "highdim"):
        UCIDataModule(dataset, root=str(uci_root)).prepare_data()
    assert no_uci_network == []


def test_a_copy_in_root_is_read_from_root(uci_root, tmp_path):
    shutil.copy(uci_root / WHITE, tmp_path / WHITE)
    dm = _setup(dataset="whitewine", root=str(tmp_path))
    assert dm.path == tmp_path / WHITE and dm.train_data.shape == (3969, 11)


# -- options -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 0}, "dim"),
        ({"dim": -3}, "dim"),
        ({"dataset": "highdim", "dim": 0}, "dim"),
        ({"batch_size": 0}, "batch_size"),
        ({"eval_batch_size": 0}, "eval_batch_size"),
        ({"noise_std": -0.1}, "noise_std"),
        ({"noise_std": math.nan}, "noise_std"),
        ({"num_workers": -1}, "num_workers"),
        ({"whiten_on": "test"}, "whiten_on"),
        ({"dataset": "mnist"}, "dataset"),
        ({"prune_rule": "fast"}, "prune_rule"),
    ],
)
def test_bad_options_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        UCIDataModule(**kwargs)


def test_jsonargparse_instantiates_from_a_class_path_config(uci_root):
    jsonargparse = pytest.importorskip("jsonargparse")
    pl = pytest.importorskip("pytorch_lightning")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(pl.LightningDataModule, "data")
    config = {"data": {"class_path": "deqscore.data.UCIDataModule",
                       "init_args": {"dataset": "parkinsons", "root": str(uci_root), "whiten_on": "train"}}}
    dm = parser.instantiate_classes(parser.parse_object(config)).data
    assert isinstance(dm, UCIDataModule) and dm.whiten_on == "train" and dm.batch_size == 200
    config["data"]["init_args"]["dataset"] = "gas"
    with pytest.raises(jsonargparse.ArgumentError):
        parser.parse_object(config)


# -- synthetic Gaussian ------------------------------------------------------------------------------------


def test_highdim_moments_and_true_density():
    dm = _setup(dataset="highdim", dim=200, root="/nonexistent-deqscore-root")
    assert dm.dim == 200 and dm.path is None
    assert [len(d) for d in (dm.train_data, dm.val_data, dm.test_data)] == [4860, 540, 600]
    x = dm.train_data.double()
    assert x.mean(dim=0).abs().max() < 0.08  # per-coordinate standard error 1/sqrt(4860) = 0.014
    cov = torch.cov(x.T)
    assert (cov - torch.eye(200, dtype=torch.float64)).abs().max() < 0.1
    assert torch.diagonal(cov).mean().item() == pytest.approx(1.0, abs=0.01)
    assert torch.equal(dm.true_score(dm.test_data), -dm.test_data)
    expected = torch.distributions.Normal(0.0, 1.0).log_prob(dm.test_data.double()).sum(dim=1)
    assert torch.allclose(dm.true_log_prob(dm.test_data.double()), expected, rtol=1e-12, atol=1e-9)
    with pytest.raises(ValueError, match="200"):
        dm.true_score(torch.zeros(3, 5))
    assert dm.whiten_matrix is None and dm.source_columns is None


def test_highdim_score_is_the_gradient_of_the_log_density():
    dm = _setup(dataset="highdim", dim=6)
    x = dm.val_data[:10].double().requires_grad_(True)
    (grad,) = torch.autograd.grad(dm.true_log_prob(x).sum(), x)
    assert torch.allclose(grad, dm.true_score(x.detach()))


# -- loaders -----------------------------------------------------------------------------------------------


def test_loaders_batches_and_order(uci_root):
    dm = _setup(dataset="redwine", root=str(uci_root), batch_size=200, eval_batch_size=100)
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, EpochShuffleSampler) and loader.drop_last
    batches = list(loader)
    assert len(batches) == 1296 // 200 and all(len(b) == 1 and b[0].shape == (200, 11) for b in batches)
    seen = torch.cat([b[0] for b in batches])
    assert not torch.equal(seen, dm.train_data[:1200])  # shuffled
    rows = {tuple(r.tolist()) for r in dm.train_data}
    assert all(tuple(r.tolist()) in rows for r in seen) and len({tuple(r.tolist()) for r in seen}) == 1200
    loader.sampler.set_epoch(1)  # Lightning does this every epoch
    assert not torch.equal(torch.cat([b[0] for b in loader]), seen)
    val = list(dm.val_dataloader())
    assert [b[0].shape[0] for b in val] == [100, 44]
    assert torch.equal(torch.cat([b[0] for b in val]), dm.val_data)
    assert torch.equal(torch.cat([b[0] for b in dm.test_dataloader()]), dm.test_data)


def test_training_set_smaller_than_a_batch_is_one_batch(uci_root):
    dm = _setup(dataset="redwine", root=str(uci_root), batch_size=5000)
    loader = dm.train_dataloader()
    assert not loader.drop_last and [b[0].shape[0] for b in loader] == [1296]
    assert dm.eval_batch_size == 5000


def test_loaders_need_setup():
    dm = UCIDataModule("highdim", dim=3)
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_subset(4)


def test_train_subset(uci_root):
    dm = _setup(dataset="parkinsons", root=str(uci_root))
    a = dm.train_subset(300, torch.Generator().manual_seed(3))
    b = dm.train_subset(300, torch.Generator().manual_seed(3))
    c = dm.train_subset(300, torch.Generator().manual_seed(4))
    assert a.shape == (300, 15) and torch.equal(a, b) and not torch.equal(a, c)
    rows = {tuple(r.tolist()) for r in dm.train_data}
    picked = {tuple(r.tolist()) for r in a}
    assert len(picked) == 300 and picked <= rows  # distinct training rows
    assert dm.train_subset(len(dm.train_data)).shape == dm.train_data.shape
    with pytest.raises(ValueError, match="4760"):
        dm.train_subset(4761)


def test_lightning_trainer_fits_a_gaussian(uci_root, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")

    class Gaussian(pl.LightningModule):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.mean = torch.nn.Parameter(torch.zeros(dim))
            self.log_std = torch.nn.Parameter(torch.zeros(dim))

        def nll(self, x):
            z = (x - self.mean) * torch.exp(-self.log_std)
            return (0.5 * z**2 + self.log_std + 0.5 * math.log(2 * math.pi)).sum(dim=1).mean()

        def training_step(self, batch, batch_idx):
            return self.nll(batch[0])

        def validation_step(self, batch, batch_idx):
            self.log("val_nll", self.nll(batch[0]))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    dm = UCIDataModule("redwine", root=str(uci_root), batch_size=100)
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(Gaussian(dm.dim), datamodule=dm)
    nll = trainer.callback_metrics["val_nll"].item()
    # whitened data with 0.05 noise: a standard normal is near optimal, 11 * 0.5 * log(2 pi e) = 15.6
    assert math.isfinite(nll) and nll < 17.0


def test_the_whitening_jacobian_is_that_of_the_fitted_covariance():
    # whitening makes the covariance the identity, so |det W| = det(cov)^(-1/2), whatever the rotation
    rng = np.random.default_rng(0)
    data = rng.standard_normal((500, 4)) @ rng.standard_normal((4, 4)) + 3.0
    _, matrix = uci_module.fit_whitening(data)
    expected = -0.5 * np.linalg.slogdet(np.cov(data.T, bias=True))[1]
    assert np.linalg.slogdet(matrix)[1] == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize(("dataset", "log_det"), [("redwine", 12.04), ("whitewine", 12.40), ("parkinsons", 44.09)])
def test_log_det_whitening_of_the_uci_sets(uci_root, dataset, log_det):
    dm = _setup(dataset=dataset, root=str(uci_root))
    assert dm.log_det_whitening == pytest.approx(log_det, abs=0.01)
    assert _setup(dataset="highdim", dim=5).log_det_whitening == 0.0
