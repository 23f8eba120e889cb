"""The kernel-regression command and the DEQ-vs-MLP study at a tiny budget: outputs, resumption, the pieces."""

import json

import pytest
import torch

from deqscore.bench import deq_vs_ffn, kernels
from deqscore.bench.deq_vs_ffn import DENSITIES, Density, build, mlp_parameters, participation_ratio
from deqscore.metrics import parameter_count

TINY = ["--steps", "3", "--seeds", "2", "--dims", "2", "--densities", "steep4,osc4", "--models", "deq,ffn2",
        "--batch", "32", "--eval-samples", "128"]


def stein_z(density: Density, x: torch.Tensor) -> float:
    """Largest |z-score| of Stein's identity E[s_1(x) f(x_1) + f'(x_1)] = 0 over a few test functions f."""
    s1, x1, w = density.score(x)[:, 0], x[:, 0], density.param
    worst = 0.0
    for f, df in ((torch.ones_like(x1), torch.zeros_like(x1)), (x1, torch.ones_like(x1)),
                  (torch.sin(w * x1), w * torch.cos(w * x1)),
                  (torch.sin(x1), torch.cos(x1)), (torch.tanh(2 * x1), 2 / torch.cosh(2 * x1) ** 2)):
        t = s1 * f + df
        worst = max(worst, abs(t.mean().item()) / (t.std().item() / len(t) ** 0.5))
    return worst


@pytest.mark.parametrize("density", DENSITIES, ids=lambda d: d.name)
def test_samplers_and_scores_agree(density):
    """Stein's identity holds for the sampler's draws and fails for draws from N(0, I) (the proposal)."""
    gen = torch.Generator().manual_seed(0)
    assert stein_z(density, density.sample(200_000, 2, gen)) < 4.5
    assert stein_z(density, torch.randn(200_000, 2, generator=gen)) > 8


@pytest.mark.parametrize("dim", [2, 8])
@pytest.mark.parametrize("model", ["ffn2", "ffn4", "ffn8"])
def test_mlps_match_the_deq_parameters_within_5_percent(dim, model):
    deq, mlp = parameter_count(build("deq", dim, 64)), parameter_count(build(model, dim, 64))
    assert abs(mlp - deq) <= 0.05 * deq
    assert mlp == mlp_parameters(dim, build(model, dim, 64).out.in_features, int(model[3:]))


def test_participation_ratio_counts_directions():
    g = torch.Generator().manual_seed(0)
    assert participation_ratio(torch.randn(20_000, 4, generator=g)) == pytest.approx(4, rel=0.05)
    assert participation_ratio(torch.randn(20_000, 1, generator=g) * torch.ones(1, 4)) == pytest.approx(1, rel=1e-6)


def test_study_tiny_budget_writes_results_and_resumes(tmp_path, monkeypatch):
    doc = deq_vs_ffn.main([*TINY, "--out", str(tmp_path)])
    units = sorted((tmp_path / "units").glob("*.json"))
    assert len(units) == 2 * 2 * 2 * 2  # densities x models x losses x seeds
    for f in ("deq_vs_ffn.md", "deq_vs_ffn.json", "fisher_steep.png", "fisher_osc.png", "advantage.png"):
        assert (tmp_path / f).stat().st_size > 0
    rows = doc["sections"]["results"]["rows"]
    assert {r["model"] for r in rows} == {"deq", "ffn2"} and all(r["seeds"] == 2 for r in rows)
    deq = [r for r in rows if r["model"] == "deq"]
    assert all(r["solver_iters"] >= 1 and r["fisher_se"] is not None for r in deq)
    assert len(doc["sections"]["advantage"]["rows"]) == 4
    assert json.loads((tmp_path / "deq_vs_ffn.json").read_text())["settings"]["steps"] == 3

    def refuse(*args):
        raise AssertionError("a recorded unit was run again")

    monkeypatch.setattr(deq_vs_ffn, "run_unit", refuse)
    again = deq_vs_ffn.main([*TINY, "--out", str(tmp_path)])
    assert again["sections"]["results"]["rows"] == rows
    partial = deq_vs_ffn.main([*TINY, "--densities", "steep4,steep16", "--report-only", "--out", str(tmp_path)])
    assert {r["param"] for r in partial["sections"]["results"]["rows"]} == {4}  # only what is on disk


def test_kernel_regression_tiny_budget_writes_results_and_resumes(tmp_path, monkeypatch):
    argv = ["--n-train", "60", "--n-test", "40", "--depths", "1,3", "--out", str(tmp_path)]
    doc = kernels.main(argv)
    rows = doc["sections"]["kernel_regression"]["rows"]
    names = {(r["kernel"], r["depth"]) for r in rows}
    assert names == {("deq_ntk", None), ("deq_nngp", None), ("fc_ntk", 1), ("fc_ntk", 3), ("fc_nngp", 1),
                     ("fc_nngp", 3), ("inj_ntk", 1), ("inj_ntk", 3)}
    assert all(20 < r["accuracy"] <= 100 for r in rows)  # far above chance (10 %) even on 60 images
    for f in ("kernels.md", "kernels.json", "accuracy_vs_depth.png"):
        assert (tmp_path / f).stat().st_size > 0
    monkeypatch.setattr(kernels, "run_unit", lambda *a: (_ for _ in ()).throw(AssertionError("ran again")))
    assert kernels.main(argv)["sections"]["kernel_regression"]["rows"] == rows


def test_regression_interpolates_the_training_set():
    X, y, _, _ = kernels.mnist(50, 10)
    K = kernels.deq_ntk(X, X, 0.5, 0.3, 0.2)
    assert torch.equal(kernels.regress(K, K, y, 10, 0.0), y)
