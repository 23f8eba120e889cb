"""``sample.py`` draws from a checkpoint of every family: a tiny trained checkpoint per family (one of its configs,
a DEQ one where it has one, shrunk as test_families.py shrinks it), sampled by the program. Images are written as
images; points (DKEF) in the data's own units, with a plot against the held-out rows: a density plot in 2
dimensions, pairwise scatter plots in more. The samples of a DKEF are those of its density (a known one checked
here)."""

import numpy as np
import pytest
import torch

import sample
from deqscore.cli.train import main
from deqscore.data import UCIDataModule
from deqscore.data.points import Whitening
from deqscore.families import ROOT
from deqscore.lightning import load_module
from deqscore.lightning.dkef import DKEFModule
from deqscore.models import DKEF
from deqscore.sampling import Langevin

from .config_losses import TWO_STEPS
from .conftest import FAMILY_TINY, tiny_args

UCI = ROOT / "datasets" / "uci"


def _trained(tmp_path, config, *extra) -> torch.nn.Module:
    main(["fit", *tiny_args(tmp_path, config, "f"), *TWO_STEPS, *extra])
    return tmp_path / "f" / "checkpoints" / "last.ckpt"


def _sample(checkpoint, out, *extra) -> None:
    assert sample.main([str(a) for a in ("--checkpoint", checkpoint, "--out", out, "--num-samples", 6,
                                         "--batch-size", 4, "--seed", 3, "--device", "cpu", *extra)]) == 0


def sampled_config(family: str):
    """The family's config sampled here: a DEQ one where it has one, on the smallest images (MNIST) or none."""
    return min(FAMILY_TINY[family][0], key=lambda p: (not p.stem.startswith("deq"),
                                                       any(big in p.stem for big in ("celeba", "cifar")), p.name))


@pytest.mark.parametrize("family", sorted(FAMILY_TINY))
def test_sample_py_draws_from_a_checkpoint_of_every_family(family, tmp_path, capsys):
    config = sampled_config(family)
    checkpoint = _trained(tmp_path, config)
    module = load_module(checkpoint).eval()
    steps = ["--steps", "3"] if hasattr(module, "sampler") else []  # annealed: 3 steps per level
    _sample(checkpoint, tmp_path / "s", *steps)
    out = capsys.readouterr().out.strip().splitlines()[-1]
    arr = np.load(tmp_path / "s" / "samples.npz")["samples"]
    assert (tmp_path / "s" / "samples.png").stat().st_size > 0 and np.isfinite(arr).all()
    if module.image_codec is not None:
        assert arr.shape == (6, *module.image_codec.image_shape) and arr.min() >= 0 and arr.max() <= 1
        return
    # points in the data's units: the whitening of the data the model was trained on, undone
    data = UCIDataModule(**{k: v for k, v in module.data_source.items() if k != "class_path"})
    data.setup("test")
    assert module.whitening == data.whitening and module.whitening is not None
    assert arr.shape == (6, data.dim)
    module.sampler.n_steps = 3
    torch.manual_seed(3)
    whitened = torch.cat([module.sample(4), module.sample(2)])
    np.testing.assert_allclose(arr, data.whitening.to_data(whitened.double()).numpy(), rtol=1e-5, atol=1e-5)
    assert np.abs(arr.mean(0) - data.whitening.mean).max() < np.abs(arr - data.whitening.mean).max()  # sanity
    assert "in the data's units" in out and "Metropolis acceptance" in out
    assert f"a pairwise scatter plot of dimensions (1, 2), (3, 4), (5, 6), (7, 8) against {len(data.test_data)} " \
           "held-out points" in out
    # without the data files (moved away), the samples are drawn and plotted alone, and the note says why
    _sample(checkpoint, tmp_path / "t", *steps, "--data-dir", tmp_path / "nowhere")
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert "(5, 6), (7, 8) to " in out and "the held-out data could not be read (" in out and "nowhere" in out
    np.testing.assert_array_equal(np.load(tmp_path / "t" / "samples.npz")["samples"], arr)


def test_a_two_dimensional_point_model_gets_a_density_plot(tmp_path, capsys):
    config = sampled_config("dkef")
    checkpoint = _trained(tmp_path, config, "--data.init_args.dataset", "highdim", "--data.init_args.dim", "2")
    _sample(checkpoint, tmp_path / "s", "--steps", "4", "--step-size", "0.05")
    out = capsys.readouterr().out.strip().splitlines()[-1]
    arr = np.load(tmp_path / "s" / "samples.npz")["samples"]
    assert arr.shape == (6, 2) and "a density plot against 600 held-out points" in out
    assert "data's units" not in out  # synthetic data: no whitening to undo


def test_a_dkef_samples_its_density():
    """With alpha = 0 a DKEF's density is its base N(0, q0_std^2 I); through a whitening W the samples in the data's
    units are N(mean, q0_std^2 W^-T W^-1)."""
    torch.manual_seed(0)
    net = DKEF(dim=2, n_centres=4, hidden=4, feature_net="shallow", bandwidth_init="fixed").double()
    net.init_centres(torch.randn(8, 2, dtype=torch.float64))
    net.set_alpha(torch.zeros(4, dtype=torch.float64))
    module = DKEFModule(net, sampler=Langevin(n_steps=60, step_size=0.8, progress=False))
    mean, matrix = np.array([3.0, -1.0]), np.array([[0.5, 0.2], [0.0, 2.0]])
    module.whitening = Whitening(mean, matrix)
    n = 3000
    points = module.sample_points(n).numpy()
    expected = 4.0 * np.linalg.inv(matrix).T @ np.linalg.inv(matrix)  # q0_std = 2
    se_mean = np.sqrt(np.diag(expected) / n)
    se_cov = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / n)
    assert (np.abs(points.mean(0) - mean) < 4 * se_mean).all(), points.mean(0)
    assert (np.abs(np.cov(points.T) - expected) < 4 * se_cov).all(), np.cov(points.T)


def test_solver_tol_sets_the_deq_tolerance_while_sampling(tmp_path, capsys):
    """A looser tolerance stops every solve sooner: fewer solver iterations per evaluation, as sample.py prints."""
    checkpoint = _trained(tmp_path, sampled_config("ncsn"))

    def iterations(*extra: str) -> float:
        _sample(checkpoint, tmp_path / "s", "--steps", "3", *extra)
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sampling cost:"))
        return float(line.split("DEQ solver iterations ")[1].split(" per evaluation")[0])

    assert 1 <= iterations("--solver-tol", "0.5") < iterations("--solver-tol", "1e-6")
