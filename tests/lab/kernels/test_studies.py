"""The kernel-regression command and the DEQ-vs-MLP study at a tiny budget: outputs, resumption, the pieces."""


import pytest
import torch

from deqlab import deq_vs_ffn, main
from deqlab.deq_vs_ffn import DEQNet, Task, build, comparisons, ffn_parameters, judge, load_protocol
from deqlab.kernels import regression as kernels
from deqscore.deq import deq_backward
from deqscore.metrics import parameter_count

PROTOCOL, _ = load_protocol()
TINY = ["--steps", "3", "--seeds", "2", "--dims", "2", "--networks", "deq,ffn2"]


def stein_z(task: Task, x: torch.Tensor) -> float:
    """Largest |z-score| of Stein's identity E[s_1(x) f(x_1) + f'(x_1)] = 0 over a few test functions f."""
    s1, x1 = task.target(x)[:, 0], x[:, 0]
    worst = 0.0
    for f, df in ((torch.ones_like(x1), torch.zeros_like(x1)), (x1, torch.ones_like(x1)),
                  (torch.sin(x1), torch.cos(x1)), (torch.tanh(2 * x1), 2 / torch.cosh(2 * x1) ** 2)):
        t = s1 * f + df
        worst = max(worst, abs(t.mean().item()) / (t.std().item() / len(t) ** 0.5))
    return worst


@pytest.mark.parametrize("a", [1.4, 16.0, 256.0])
def test_score_task_sampler_and_score_agree(a):
    """Stein's identity holds for the sampler's draws and fails for draws from N(0, I) (the proposal)."""
    task, gen = Task("score", 3, a), torch.Generator().manual_seed(0)
    assert stein_z(task, task.sample(200_000, gen)) < 4.5
    assert stein_z(task, torch.randn(200_000, 3, generator=gen)) > 8


@pytest.mark.parametrize("kind", ["regression", "score"])
def test_tasks_have_the_stated_slope_at_zero(kind):
    """d target_1 / d x_1 at 0 by central differences: a for the regression, -(1 + a) for the score."""
    task, h = Task(kind, 4, 16.0), 1e-4
    e1 = torch.zeros(1, 4, dtype=torch.float64)
    e1[0, 0] = h
    slope = float((task.target(e1) - task.target(-e1))[0, 0] / (2 * h))
    assert slope == pytest.approx(16.0 if kind == "regression" else -17.0, rel=1e-6)


@pytest.mark.parametrize("dim", [2, 32])
@pytest.mark.parametrize("network", ["ffn2", "ffn4", "ffn8"])
def test_feed_forward_nets_match_the_deq_parameters_within_5_percent(dim, network):
    task = Task("score", dim, 2.0)
    deq, ffn = parameter_count(build("deq", task, PROTOCOL)), build(network, task, PROTOCOL)
    assert abs(parameter_count(ffn) - deq) <= 0.05 * deq
    width = ffn.body[0].weight.shape[0]
    assert parameter_count(ffn) == ffn_parameters(dim, dim, width, int(network[3:]))


def blown_up(net: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("original"):
                p.mul_(50.0)
    return net


@pytest.mark.parametrize("network", ["deq", "ffn2", "ffn8"])
def test_budget_caps_every_weight_and_the_slope(network):
    """Weights 50 times too large: every matrix sits at its bound, and no slope exceeds the Lipschitz cap."""
    task = Task("regression", 4, 16.0)
    torch.manual_seed(0)
    net = blown_up(build(network, task, PROTOCOL))
    bound = PROTOCOL["budget"]["weight_spectral_bound"]
    for name, m in net.named_modules():
        if isinstance(m, torch.nn.Linear):
            want = PROTOCOL["budget"]["deq_contraction_bound"] if name == "deq.func.lin" else bound
            assert float(torch.linalg.matrix_norm(m.weight.detach(), ord=2)) == pytest.approx(want, rel=1e-5)
    x = torch.randn(512, 4).requires_grad_(True)
    (g,) = torch.autograd.grad(net(x).sum(), x)
    assert float(g.norm(dim=1).max()) <= net.lipschitz_cap * (1 + 1e-5)
    assert net.lipschitz_cap == (bound**2 / (1 - 0.9) if network == "deq" else bound ** (int(network[3:]) + 1))


@pytest.mark.parametrize("kind", ["regression", "score"])
def test_deq_parameter_gradient_is_the_unrolled_one(kind):
    """The phantom steps (K = 40 on a 0.9-contraction) give the exact parameter gradient of the training loss,
    the recurrent weight's included (a weight cached without autograd would get none)."""
    task = Task(kind, 3, 4.0)
    torch.manual_seed(1)
    net = blown_up(build("deq", task, PROTOCOL))
    assert isinstance(net, DEQNet)
    x = task.sample(64, torch.Generator().manual_seed(2))

    def grads():
        torch.manual_seed(3)  # the same projections for SSM-VR
        return torch.autograd.grad(task.loss(net, x), list(net.parameters()), allow_unused=True)

    phantom = grads()
    net.deq.tol, net.deq.max_iter = 1e-7, 2000
    with deq_backward(net, "unroll"):
        exact = grads()
    for p, e in zip(phantom, exact, strict=True):
        assert p is not None and float((p - e).norm() / e.norm()) < 1e-3


def comparison(task, dim, ffn, outcome):
    return {"task": task, "dim": dim, "ffn": ffn, "outcome": outcome}


def test_predictions_are_judged_by_their_named_comparisons():
    preds = [{"id": "A", "text": "", "task": "*", "dim": 32, "ffn": "ffn2", "expected": "deq_better"},
             {"id": "B", "text": "", "task": "*", "dim": 2, "ffn": "*", "expected": "not ffn_better"},
             {"id": "C", "text": "", "task": "score", "dim": 16, "ffn": "ffn8", "expected": "ffn_better"},
             {"id": "D", "text": "", "task": "*", "dim": 8, "ffn": "*", "expected": "deq_better"}]
    compared = [comparison("regression", 32, "ffn2", "deq_better"), comparison("score", 32, "ffn2", "deq_better"),
                comparison("regression", 2, "ffn4", "equivalent"), comparison("score", 2, "ffn8", "ffn_better"),
                comparison("score", 16, "ffn8", "inconclusive")]
    assert [j["verdict"] for j in judge(preds, compared)] == ["borne out", "contradicted", "open", "not run"]


def test_comparisons_apply_the_margin_on_log10_metrics():
    rows = [{"task": "score", "dim": 2, "a": 1.4, "network": n, "log10_metric": v}
            for n, v in (("deq", [0.0, 0.02, -0.02]), ("ffn2", [0.5, 0.52, 0.48]), ("ffn4", [-0.5, -0.52, -0.48]),
                         ("ffn8", [0.0, 0.01, -0.01]))]
    got = {c["ffn"]: c["outcome"] for c in comparisons(rows, 0.1)}
    assert got == {"ffn2": "deq_better", "ffn4": "ffn_better", "ffn8": "equivalent"}


def test_study_tiny_budget_writes_results_shards_and_resumes(tmp_path, monkeypatch):
    first = main(["deq_vs_ffn", *TINY, "--shard", "0/2", "--out", str(tmp_path)])
    assert first["units"] == 4  # every other unit of 2 tasks x 2 networks x 2 seeds
    doc = main(["deq_vs_ffn", *TINY, "--shard", "1/2", "--out", str(tmp_path)])  # its own half, the other half read
    assert doc["units"] == 8 and len(list((tmp_path / "units").glob("*.json"))) == 8
    assert (tmp_path / "deq_vs_ffn.md").stat().st_size > 0
    rows = doc["sections"]["results"]["rows"]
    assert {r["network"] for r in rows} == {"deq", "ffn2"} and all(r["seeds"] == 2 for r in rows)
    assert all(r["solver_iters"] >= 1 and r["gradient_error"] < 1e-3 for r in rows if r["network"] == "deq")
    assert len(doc["sections"]["comparisons"]["rows"]) == 2
    assert doc["off_protocol"]["steps"] == 3 and "Off protocol" in (tmp_path / "deq_vs_ffn.md").read_text()

    def refuse(*args):
        raise AssertionError("a recorded unit was run again")

    monkeypatch.setattr(deq_vs_ffn, "run_unit", refuse)
    again = main(["deq_vs_ffn", *TINY, "--out", str(tmp_path)])
    assert again["sections"]["results"]["rows"] == rows
    other_budget = main(["deq_vs_ffn", *TINY, "--steps", "4", "--report-only", "--out", str(tmp_path)])
    assert other_budget["units"] == 0  # a unit recorded at another budget is not this study's


def test_kernel_regression_tiny_budget_writes_results_and_resumes(tmp_path, monkeypatch):
    argv = ["--n-train", "60", "--n-test", "40", "--depths", "1,3", "--out", str(tmp_path)]
    doc = main(["kernels", *argv])
    rows = doc["sections"]["kernel_regression"]["rows"]
    names = {(r["kernel"], r["depth"]) for r in rows}
    assert names == {("deq_ntk", None), ("deq_nngp", None), ("fc_ntk", 1), ("fc_ntk", 3), ("fc_nngp", 1),
                     ("fc_nngp", 3), ("inj_ntk", 1), ("inj_ntk", 3)}
    assert all(20 < r["accuracy"] <= 100 for r in rows)  # far above chance (10 %) even on 60 images
    for f in ("kernels.md", "kernels.json", "accuracy_vs_depth.png"):
        assert (tmp_path / f).stat().st_size > 0
    monkeypatch.setattr(kernels, "run_unit", lambda *a: (_ for _ in ()).throw(AssertionError("ran again")))
    assert main(["kernels", *argv])["sections"]["kernel_regression"]["rows"] == rows


def test_regression_interpolates_the_training_set():
    X, y, _, _ = kernels.mnist(50, 10)
    K = kernels.deq_ntk(X, X, 0.5, 0.3, 0.2)
    assert torch.equal(kernels.regress(K, K, y, 10, 0.0), y)
