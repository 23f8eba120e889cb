"""The DEQ-vs-FFN study (protocol v3) at a tiny budget and its pieces: the tasks, one Lipschitz budget per
comparison (caps by SVD), the provable floor against Monte Carlo, the selection rule, and the verdict rule on
hand-made cases."""

import math

import pytest
import torch

from deqlab import deq_vs_ffn, main
from deqlab.deq_vs_ffn import (
    DEQNet,
    Task,
    budget,
    build,
    clipped_fit_floor,
    comparisons,
    ffn_parameters,
    judge,
    load_protocol,
    plan,
)
from deqlab.deq_vs_ffn import training as training_module
from deqscore.deq import deq_backward
from deqscore.metrics import parameter_count

PROTOCOL, _ = load_protocol()
TINY = ["--only", "control:2:deq,control:2:ffn2", "--seeds", "2", "--start-steps", "3", "--max-steps", "6",
        "--lrs", "0.01,0.003"]


def stein_z(task: Task, x: torch.Tensor) -> float:
    """Largest |z-score| of Stein's identity E[s_1(x) f(x_1) + f'(x_1)] = 0 over a few test functions f."""
    s1, x1 = task.target(x)[:, 0], x[:, 0]
    worst = 0.0
    for f, df in ((torch.ones_like(x1), torch.zeros_like(x1)), (x1, torch.ones_like(x1)),
                  (torch.sin(x1), torch.cos(x1)), (torch.tanh(2 * x1), 2 / torch.cosh(2 * x1) ** 2)):
        t = s1 * f + df
        worst = max(worst, abs(t.mean().item()) / (t.std().item() / len(t) ** 0.5))
    return worst


@pytest.mark.parametrize("a", [1.4, 256.0])
def test_score_task_sampler_and_score_agree(a):
    """Stein's identity holds for the sampler's draws and fails for draws from N(0, I) (the proposal)."""
    task, gen = Task("score", 3, a), torch.Generator().manual_seed(0)
    assert stein_z(task, task.sample(200_000, gen)) < 4.5
    assert stein_z(task, torch.randn(200_000, 3, generator=gen)) > 8


def test_regression_target_has_the_stated_slope_at_zero():
    task, h = Task("regression", 4, 16.0), 1e-4
    e1 = torch.zeros(1, 4, dtype=torch.float64)
    e1[0, 0] = h
    assert float((task.target(e1) - task.target(-e1))[0, 0] / (2 * h)) == pytest.approx(16.0, rel=1e-6)


def spend(kind: str, dim: int):
    return budget(kind, 2 ** (dim / 4), PROTOCOL)


@pytest.mark.parametrize("dim", [2, 32])
@pytest.mark.parametrize("network", ["ffn2", "ffn8"])
def test_feed_forward_nets_match_the_deq_parameters_within_5_percent(dim, network):
    task, b = Task("regression", dim, 2.0), spend("control", dim)
    deq, ffn = parameter_count(build("deq", task, b, PROTOCOL)), build(network, task, b, PROTOCOL)
    assert abs(parameter_count(ffn) - deq) <= 0.05 * deq
    assert parameter_count(ffn) == ffn_parameters(dim, 1, ffn.body[0].weight.shape[0], int(network[3:]))


def test_flop_matched_network_has_the_deq_width_and_54_layers():
    ffn = build("ffn54", Task("regression", 32, 256.0), spend("control", 32), PROTOCOL)
    linears = [m for m in ffn.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 55 and all(m.weight.shape[0] == 48 for m in linears[:-1])


def test_steepening_rule_keeps_the_phantom_accuracy_and_the_weights():
    """gamma_d -> 1 from d = 24, constant B; K_d is the least K with gamma_d^K <= 0.9^40."""
    gammas = {d: spend("steep", d).gamma for d in (2, 16, 24, 32)}
    assert gammas == {2: 0.9, 16: 0.9, 24: 0.96875, 32: 0.9921875}
    for d in (24, 32):
        b = spend("steep", d)
        assert b.gamma ** b.phantom_steps <= 0.9**40 < b.gamma ** (b.phantom_steps - 1)
        assert b.lipschitz == pytest.approx(2 * 2 ** (d / 4)) and b.bound == 2.0


def blown_up(net: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("original"):
                p.mul_(50.0)
    return net


@pytest.mark.parametrize(("kind", "network"), [("control", "deq"), ("control", "ffn2"), ("control", "ffn8"),
                                               ("steep", "deq_steep"), ("steep", "ffn2")])
def test_every_network_of_a_comparison_has_the_one_lipschitz_budget(kind, network):
    """Weights 50 times too large: by SVD every matrix sits at its cap, the caps multiply to the comparison's
    budget (40, or 512 for the steepening one at d = 32), and no input gradient exceeds it."""
    task, b = Task("regression", 32, 256.0), spend(kind, 32)
    torch.manual_seed(0)
    net = blown_up(build(network, task, b, PROTOCOL))
    norms = {name: float(torch.linalg.matrix_norm(m.weight.detach(), ord=2))
             for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)}
    if isinstance(net, DEQNet):
        assert norms.pop("deq.func.lin") == pytest.approx(b.gamma, rel=1e-5)
        product = math.prod(norms.values()) / (1 - b.gamma)
    else:
        product = math.prod(norms.values())
    assert product == pytest.approx(b.lipschitz, rel=1e-4) == pytest.approx(40.0 if kind == "control" else 512.0)
    assert deq_vs_ffn.weight_norms(net)["spectral_product"] == pytest.approx(product, rel=1e-4)
    x = torch.randn(256, 32).requires_grad_(True)
    (g,) = torch.autograd.grad(net(x).sum(), x)
    assert float(g.norm(dim=1).max()) <= b.lipschitz * (1 + 1e-4)


@pytest.mark.parametrize(("lipschitz", "a", "expected"), [(8.0, 256.0, 0.174), (8.0, 16.0, 0.058),
                                                          (40.0, 256.0, 0.0627)])
def test_floor_is_the_clipped_fit_by_monte_carlo(lipschitz, a, expected):
    """The quadrature against an independent Monte Carlo estimate (2e6 draws, 4 standard errors) of the clipped
    fit's RMSE; the values the protocol quotes."""
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).abs()
    sq = (torch.tanh(a * x) - torch.minimum(lipschitz * x, torch.tanh(a * x))).pow(2)
    mc, se = float(sq.mean()), float(sq.std() / len(sq) ** 0.5)
    floor = clipped_fit_floor(a, lipschitz)
    assert abs(floor**2 - mc) < 4 * se
    assert floor == pytest.approx(expected, abs=6e-4)


def test_floor_limits():
    """No floor once the budget reaches the slope; with a budget of 0 the floor is the trivial RMSE of predicting
    0, E[tanh(a x)^2]^(1/2) (here against a fine trapezoid rule of its own)."""
    assert clipped_fit_floor(16.0, 16.0) == 0.0 == clipped_fit_floor(16.0, 40.0)
    x = torch.linspace(-12, 12, 400_001, dtype=torch.float64)
    trivial = float(torch.trapezoid(torch.tanh(4 * x) ** 2 * torch.exp(-x * x / 2), x) / math.sqrt(2 * math.pi))
    assert clipped_fit_floor(4.0, 1e-12) == pytest.approx(math.sqrt(trivial), rel=1e-6)


def test_deq_parameter_gradient_is_the_unrolled_one():
    """The phantom steps (K = 40 on a 0.9-contraction) give the exact parameter gradient of the training loss,
    the recurrent weight's included (a weight cached without autograd would get none)."""
    task = Task("regression", 3, 4.0)
    torch.manual_seed(1)
    net = blown_up(build("deq", task, spend("control", 3), PROTOCOL))
    x = task.sample(64, torch.Generator().manual_seed(2))

    def grads():
        return torch.autograd.grad(task.loss(net, x), list(net.parameters()), allow_unused=True)

    phantom = grads()
    net.deq.tol, net.deq.max_iter = 1e-7, 2000
    with deq_backward(net, "unroll"):
        exact = grads()
    for p, e in zip(phantom, exact, strict=True):
        assert p is not None and float((p - e).norm() / e.norm()) < 1e-3


@pytest.mark.parametrize(("falling", "steps"), [(True, 12), (False, 3)])
def test_a_run_doubles_its_steps_while_still_falling(monkeypatch, falling, steps):
    monkeypatch.setattr(training_module, "still_falling", lambda curve, protocol: falling)
    proto = {**PROTOCOL, "training": {**PROTOCOL["training"], "start_steps": 3, "max_steps": 12}}
    run = training_module.train(Task("regression", 2, 1.4), "ffn2", spend("control", 2), 0, 0.01, proto)
    assert run["steps"] == steps and run["curve"][-1][0] == steps and run["still_falling"] is falling
    fixed = training_module.train(Task("regression", 2, 1.4), "ffn2", spend("control", 2), 0, 0.01, proto, steps=5)
    assert fixed["steps"] == 5


def arm(budget_kind, dim, network, logs, marked=False):
    return {"budget": budget_kind, "dim": dim, "network": network, "log10_metric": logs, "marked": marked}


A, B_EQ, B_WORSE, B_BETTER = [0.0, 0.01, -0.01], [0.0, 0.02, -0.01], [0.5, 0.52, 0.48], [-0.5, -0.52, -0.48]
NOISY = [0.3, -0.4, 0.2]  # spread too wide to decide at a margin of 0.1


def prediction(expected, others):
    return {"id": "P", "text": "", "dim": 2, "a": ["deq", "control"], "b": [[n, "control"] for n in others],
            "expected": expected}


@pytest.mark.parametrize(("arms", "verdict"), [
    ([arm("control", 2, "ffn2", B_EQ), arm("control", 2, "ffn8", B_WORSE)], "borne out"),
    # v2's rule called this one borne out: one comparison inconclusive and none against the prediction
    ([arm("control", 2, "ffn2", B_EQ), arm("control", 2, "ffn8", NOISY)], "open"),
    ([arm("control", 2, "ffn2", B_EQ), arm("control", 2, "ffn8", B_WORSE, marked=True)], "open"),
    ([arm("control", 2, "ffn2", B_BETTER), arm("control", 2, "ffn8", NOISY)], "contradicted"),
    ([arm("control", 2, "ffn2", B_BETTER, marked=True), arm("control", 2, "ffn8", B_EQ)], "open"),
    ([arm("control", 2, "ffn2", B_EQ)], "not run"),
])
def test_inconclusive_or_undecided_is_never_borne_out(arms, verdict):
    pred = prediction(["a_better", "equivalent"], ["ffn2", "ffn8"])
    got = judge([pred], [arm("control", 2, "deq", A), *arms], 0.1)[0]["verdict"]
    assert got == verdict


def test_comparisons_pair_each_deq_with_its_budget_and_the_control():
    arms = [arm("control", 32, "deq", A), arm("control", 32, "ffn2", B_WORSE), arm("steep", 32, "ffn2", B_BETTER),
            arm("steep", 32, "deq_steep", B_EQ)]
    got = {(c["a"], c["b"]): c["outcome"] for c in comparisons(arms, 0.1)}
    assert got == {("deq (control)", "ffn2 (control)"): "a_better", ("deq_steep (steep)", "deq (control)"):
                   "equivalent", ("deq_steep (steep)", "ffn2 (steep)"): "b_better"}


def test_order_covers_the_protocols_arms():
    arms = {(a["budget"], d, n) for a in PROTOCOL["arms"] for d in a["dims"] for n in a["networks"]}
    assert set(plan(PROTOCOL)) == arms and len(plan(PROTOCOL)) == len(arms) == len(deq_vs_ffn.ORDER)


def test_study_tiny_budget_writes_the_page_and_resumes(tmp_path, monkeypatch):
    doc = main(["deq_vs_ffn", *TINY, "--out", str(tmp_path)])
    assert len(list((tmp_path / "units").glob("*.json"))) == 6  # 2 arms x (2 lrs + 1 further seed)
    rows = doc["sections"]["arms"]["rows"]
    assert {r["network"] for r in rows} == {"deq", "ffn2"} and all(r["seeds"] == 2 for r in rows)
    assert all(r["lipschitz_budget"] == pytest.approx(40.0) for r in rows)
    assert all(r["solver_iters"] >= 1 and r["gradient_error"] < 1e-3 for r in rows if r["network"] == "deq")
    assert doc["settings"]["off_protocol"]["max_steps"] == 6
    assert "Off protocol" in (tmp_path / "deq_vs_ffn.md").read_text()
    assert len(doc["sections"]["comparisons"]["rows"]) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("a recorded unit was run again")

    monkeypatch.setattr(deq_vs_ffn, "train", refuse)
    again = main(["deq_vs_ffn", *TINY, "--out", str(tmp_path)])
    assert again["sections"]["arms"]["rows"] == rows
    other = main(["deq_vs_ffn", *TINY[:-2], "--report-only", "--out", str(tmp_path)])
    # units of another lr grid are not this study's
    assert other["settings"]["arms"] == 0 and len(other["settings"]["missing"]) == 2


def test_an_arm_outside_the_protocol_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["deq_vs_ffn", "--only", "control:4:deq", "--report-only"])
    assert exc.value.code == 2 and "--only" in capsys.readouterr().err
