import math
import warnings
from functools import partial

import pytest
import torch

from deqscore.configfiles import load_config
from deqscore.deq import DEQ
from deqscore.errors import ConfigError
from deqscore.losses import denoising_score_matching, exact_score_matching, sliced_score_matching
from deqscore.models import DKEF
from deqscore.models.dkef import DKEFDEQMap, ImportanceProposal, effective_sample_size

NETS = ("shallow", "deep", "deq")
OBJECTIVES = ("exact", "sliced", "sliced_vr", "dsm")
SIGMA = 0.3
F64 = torch.float64


def _model(feature_net="shallow", dim=3, n_centres=5, hidden=6, phantom_steps=2, **kw):
    torch.manual_seed(1)
    deq = partial(DEQ, solver="picard", tol=1e-13, max_iter=500, phantom_steps=phantom_steps)
    model = DKEF(dim=dim, n_centres=n_centres, hidden=hidden, feature_net=feature_net, deep_layers=3, deq=deq,
                 **kw).double()
    with torch.no_grad():
        model.beta.normal_(0, 0.5)  # unequal kernel weights
        model.kernel_log_scales.add_(torch.randn(3, dtype=F64) * 0.2)
    return model


def _data(n=6, dim=3, seed=2):
    return torch.randn(n, dim, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _draws(objective, x, seed=7):
    """Fixed projections / noise, drawn exactly as the losses of deqscore.losses draw them after seeding."""
    torch.manual_seed(seed)
    return {"projections": torch.randn_like(x)} if objective in ("sliced", "sliced_vr") else (
        {"noise": torch.randn_like(x)} if objective == "dsm" else {})


# ------------------------------------------------------------------ (1) the alpha solve


def _plain_kernel(model, z):
    """The kernel mixture at one point ``z`` [D] against the centres, written out with direct differences (exact at
    a centre, independent of the model's kernel code): ``sum_j w_j exp(-||phi_j(z) - phi_j(c_m)||^2 / (2 s_j))``."""
    weights, scales = torch.softmax(model.beta, 0), 10**model.kernel_log_scales
    return sum(w * torch.exp(-(phi(z[None]) - phi(model.centres)).pow(2).sum(1) / (2 * s))
               for phi, w, s in zip(model.features, weights, scales, strict=True))


def _brute_kernel_derivs(model, x):
    """Per-sample Jacobian [B, M, D] and Hessians [B, M, D, D] of the plain kernel by autograd."""
    jacs, hessians = [], []
    for xb in x:
        def k(z):
            return _plain_kernel(model, z)

        jacs.append(torch.autograd.functional.jacobian(k, xb))
        hessians.append(torch.autograd.functional.jacobian(
            lambda z, k=k: torch.autograd.functional.jacobian(k, z, create_graph=True), xb))
    return torch.stack(jacs), torch.stack(hessians)


def _stacked_rows(model, objective, x, draws):
    """``C`` with ``G = C^T C`` and ``b``, from brute-force kernel derivatives (docs/method.md section 3.7)."""
    n = x.shape[0]
    if objective == "dsm":
        x = x + SIGMA * draws["noise"]
    jac, hess = _brute_kernel_derivs(model, x)
    grad_q0 = -x / model.q0_std**2
    jq = torch.einsum("bmd,bd->bm", jac, grad_q0)
    if objective == "exact":
        return jac.permute(0, 2, 1).reshape(-1, model.n_centres) / math.sqrt(n), (
            hess.diagonal(dim1=2, dim2=3).sum(-1) + jq).mean(0)
    if objective == "dsm":
        target = SIGMA**2 * grad_q0 + SIGMA * draws["noise"]
        rows = SIGMA**2 * jac.permute(0, 2, 1).reshape(-1, model.n_centres) / math.sqrt(n)
        return rows, SIGMA**2 * torch.einsum("bmd,bd->m", jac, target) / n
    v = draws["projections"]
    jv, vhv = torch.einsum("bmd,bd->bm", jac, v), torch.einsum("bmde,bd,be->bm", hess, v, v)
    if objective == "sliced":
        return jv / math.sqrt(n), (vhv + jv * (v * grad_q0).sum(1, keepdim=True)).mean(0)
    return jac.permute(0, 2, 1).reshape(-1, model.n_centres) / math.sqrt(n), (vhv + jq).mean(0)  # sliced_vr


@pytest.mark.parametrize("feature_net", NETS)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_alpha_matches_least_squares_of_brute_force_system(feature_net, objective):
    model, x = _model(feature_net), _data()
    with torch.no_grad():  # centres drawn from the data, as by default: the system is evaluated at the centres
        model.centres.copy_(x[: model.n_centres])
    draws = _draws(objective, x)
    gram, b = model.alpha_system(x, objective, sigma=SIGMA, **draws)
    rows, b_ref = _stacked_rows(model, objective, x, draws)
    assert torch.allclose(gram, rows.T @ rows, rtol=1e-8, atol=1e-12)
    assert torch.allclose(b, b_ref, rtol=1e-8, atol=1e-12)
    # argmin 0.5 a^T C^T C a + b^T a + 0.5 lam |a|^2 = argmin ||C a||^2 + ||sqrt(lam) a + b / sqrt(lam)||^2
    lam = 10 ** model.log_lambda.item()
    a_mat = torch.cat([rows, math.sqrt(lam) * torch.eye(model.n_centres, dtype=F64)])
    rhs = torch.cat([torch.zeros(rows.shape[0], dtype=F64), -b_ref / math.sqrt(lam)])
    expected = torch.linalg.lstsq(a_mat, rhs[:, None], driver="gelsd").solution[:, 0]
    alpha = model.solve_alpha(x, objective, sigma=SIGMA, **draws)
    assert torch.allclose(alpha, expected, rtol=1e-7, atol=1e-9)


def _loss(model, objective, x, alpha, seed=7):
    """The score-matching loss of deqscore.losses for the model with coefficients ``alpha`` (draws seeded)."""
    def score(z):
        return model.score(z, alpha)

    torch.manual_seed(seed)
    if objective == "exact":
        return exact_score_matching(score, x).mean()
    if objective == "dsm":
        return denoising_score_matching(score, x, SIGMA, weighting="sigma4").mean()
    vr = objective == "sliced_vr"
    return sliced_score_matching(score, x, projection="gaussian", variance_reduction=vr).mean()


@pytest.mark.parametrize("feature_net", ("shallow", "deq"))
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_alpha_minimises_the_real_loss(feature_net, objective):
    model, x = _model(feature_net), _data(n=8)
    with torch.no_grad():  # centres drawn from the data, as by default
        model.centres.copy_(x[: model.n_centres])
    draws = _draws(objective, x)
    lam = 10 ** model.log_lambda.item()
    alpha = model.solve_alpha(x, objective, sigma=SIGMA, create_graph=False, **draws)

    def ridge_loss_grad(a):
        a = a.clone().requires_grad_(True)
        total = _loss(model, objective, x, a) + 0.5 * lam * a.pow(2).sum()
        return torch.autograd.grad(total, a)[0]

    scale = ridge_loss_grad(torch.zeros_like(alpha)).norm()
    assert ridge_loss_grad(alpha).norm() < 1e-9 * scale
    assert ridge_loss_grad(alpha + 0.1).norm() > 1e-3 * scale  # the check can fail
    # the loss is 0.5 a^T G a + b^T a + const, for any a
    gram, b = model.alpha_system(x, objective, sigma=SIGMA, create_graph=False, **draws)
    a = torch.randn(model.n_centres, dtype=F64)
    diff = _loss(model, objective, x, a) - _loss(model, objective, x, torch.zeros_like(a))
    assert diff.item() == pytest.approx((0.5 * a @ gram @ a + b @ a).item(), rel=1e-9, abs=1e-12)


def test_solve_is_differentiable_in_log_lambda():
    model, x = _model(), _data()
    alpha = model.solve_alpha(x, "exact")
    (g,) = torch.autograd.grad(alpha.sum(), model.log_lambda)
    gram, b = model.alpha_system(x, "exact", create_graph=False)
    lam = 10 ** model.log_lambda.detach()
    h = gram + lam * torch.eye(model.n_centres, dtype=F64)
    a = torch.linalg.solve(h, -b)
    # d alpha / d log_lambda = -(H^-1) (ln 10 * lam) alpha
    expected = -torch.linalg.solve(h, math.log(10) * lam * a).sum()
    assert g.item() == pytest.approx(expected.item(), rel=1e-9)


# ------------------------------------------------------------------ (2) score


@pytest.mark.parametrize("feature_net", NETS)
def test_score_is_gradient_of_log_density(feature_net):
    model = _model(feature_net, phantom_steps=60)  # K = 60: the phantom derivative is exact to 1e-20
    x = _data(n=5)
    alpha = torch.randn(model.n_centres, dtype=F64)
    s = model.score(x, alpha)
    xg = x.clone().requires_grad_(True)
    (auto,) = torch.autograd.grad(model.log_density(xg, alpha).sum(), xg)
    assert torch.allclose(s, auto, atol=1e-12)
    h, fd = 1e-5, torch.empty_like(x)
    with torch.no_grad():
        for d in range(x.shape[1]):
            e = torch.zeros_like(x)
            e[:, d] = h
            fd[:, d] = (model.log_density(x + e, alpha) - model.log_density(x - e, alpha)) / (2 * h)
    assert torch.allclose(s, fd, atol=1e-7)


def test_score_defaults_to_stored_alpha_and_has_no_graph_under_no_grad():
    model, x = _model(), _data()
    a = torch.randn(model.n_centres, dtype=F64)
    model.set_alpha(a)
    assert torch.allclose(model.score(x), model.score(x, a))
    with torch.no_grad():
        s = model.score(x)
    assert not s.requires_grad and torch.allclose(s, model.score(x, a))
    x_req = x.clone().requires_grad_(True)  # differentiated as given: the losses take d s / dx
    assert model.score(x_req).requires_grad


def test_alpha_buffer_in_state_dict():
    model = _model()
    model.set_alpha(torch.arange(5, dtype=F64))
    sd = model.state_dict()
    assert "alpha" in sd and not any(n == "alpha" for n, _ in model.named_parameters())
    other = _model()
    other.load_state_dict(sd)
    assert torch.equal(other.alpha, torch.arange(5, dtype=F64))


def test_kernel_is_one_at_the_centres_and_in_unit_interval():
    model, x = _model(), _data(n=20)
    with torch.no_grad():
        assert torch.allclose(model.kernel(model.centres).diagonal(), torch.ones(5, dtype=F64))
        k = model.kernel(x)
    assert k.shape == (20, 5) and (k > 0).all() and (k <= 1).all()


def test_init_centres_copies_distinct_training_rows():
    model, x = _model(n_centres=5), _data(n=30)
    model.init_centres(x, generator=torch.Generator().manual_seed(0))
    match = (model.centres.detach()[:, None] == x[None]).all(-1)  # [M, N]
    assert (match.sum(1) == 1).all() and match.any(0).sum() == 5


def _per_kernel_median(model, x):
    """Median over (point, centre) pairs of each kernel ``k_j`` on its own: [3]."""
    with torch.no_grad():
        return torch.stack([
            torch.exp(-torch.cdist(phi(x), phi(model.centres)).pow(2) / (2 * 10 ** model.kernel_log_scales[j])).median()
            for j, phi in enumerate(model.features)])


@pytest.mark.parametrize("feature_net", NETS)
def test_median_bandwidth_init_puts_the_median_pair_at_exp_minus_ten_to_minus_l(feature_net):
    given = (0.0, 0.5185, -0.3)
    model = DKEF(dim=4, n_centres=7, hidden=5, feature_net=feature_net, deep_layers=3, kernel_log_scales=given,
                 bandwidth_points=41).double()  # 41 x 7 pairs: an odd count, one median
    x = _data(n=60, dim=4) * 3.0
    model.init_centres(x, generator=torch.Generator().manual_seed(0))
    # median k_j over the first 41 rows and the centres is exp(-10^-l_j(given)); the widths moved off the given ones
    expected = torch.exp(-(10 ** -torch.tensor(given, dtype=F64)))
    assert torch.allclose(_per_kernel_median(model, x[:41]), expected, rtol=1e-6)
    assert not torch.allclose(model.kernel_log_scales, torch.tensor(given, dtype=F64), atol=0.1)
    first = model.kernel_log_scales.detach().clone()
    model.init_centres(x, generator=torch.Generator().manual_seed(0))  # a second call: the same widths
    assert torch.equal(model.kernel_log_scales.detach(), first)


def test_fixed_bandwidth_init_keeps_the_given_widths():
    model = DKEF(dim=4, n_centres=7, hidden=5, feature_net="shallow", bandwidth_init="fixed").double()
    model.init_centres(_data(n=60, dim=4) * 3.0)
    assert torch.equal(model.kernel_log_scales.detach(), torch.tensor([0.0, 0.5185, 0.5185]).double())


def test_median_init_keeps_kernels_alive_in_high_dimension():
    """On N(0, I) data in 200 dimensions the fixed widths give kernels ~0 on held-out points (no gradient reaches
    the features); the median init gives kernels of order exp(-1) and a feature gradient."""
    x = torch.randn(400, 200, generator=torch.Generator().manual_seed(0))
    medians, grads = {}, {}
    for init in ("fixed", "median"):
        torch.manual_seed(0)
        model = DKEF(dim=200, n_centres=20, hidden=30, feature_net="shallow", bandwidth_init=init)
        model.init_centres(x[:300], generator=torch.Generator().manual_seed(0))
        medians[init] = model.kernel(x[300:]).median().item()
        model.kernel(x[300:]).sum().backward()
        grads[init] = sum(p.grad.norm() ** 2 for p in model.features.parameters()).sqrt().item()
    assert medians["fixed"] < 1e-10 and 0.05 < medians["median"] < 0.9
    assert grads["median"] > 1e4 * grads["fixed"]


def test_init_is_normal_with_variance_one_over_fan_out():
    model = DKEF(dim=7, n_centres=3, hidden=400, feature_net="shallow")
    lin = model.features[0].body[2]
    assert lin.weight.std().item() == pytest.approx(400**-0.5, rel=0.02)
    assert lin.bias.std().item() == pytest.approx(400**-0.5, rel=0.25)
    assert model.features[1].skip.bias is None
    assert torch.equal(model.beta, torch.zeros(3)) and model.log_lambda.item() == -2.0
    assert torch.allclose(model.kernel_log_scales, torch.tensor([0.0, 0.5185, 0.5185]))


# ------------------------------------------------------------------ (3) normaliser


@pytest.mark.parametrize("dim", [2, 5])
def test_log_partition_of_the_base_gaussian(dim):
    model = _model(dim=dim, n_centres=4)  # alpha = 0: p~ = q0, Z = (2 pi q0_std^2)^(D/2)
    truth = 0.5 * dim * math.log(2 * math.pi * model.q0_std**2)
    gen = torch.Generator().manual_seed(3)
    log_z, se = model.log_partition(n_samples=2000, chunk=512, proposal_std=2.0, generator=gen)
    assert log_z == pytest.approx(truth, abs=1e-10) and se < 1e-6  # proposal = target: constant weights
    log_z, se = model.log_partition(n_samples=40_000, chunk=4096, proposal_std=2.6, generator=gen)
    assert 1e-4 < se < 0.05 and abs(log_z - truth) < 3 * se


def _bumpy_2d_model():
    model = _model(dim=2, n_centres=6)
    with torch.no_grad():
        model.centres.copy_(torch.randn(6, 2, dtype=F64) * 1.5)
    model.set_alpha(torch.tensor([2.0, -1.5, 1.0, 3.0, -2.0, 1.5], dtype=F64))
    return model


def test_log_partition_against_quadrature():
    model = _bumpy_2d_model()
    grid = torch.linspace(-14, 14, 401, dtype=F64)
    pts = torch.cartesian_prod(grid, grid)
    with torch.no_grad():
        log_p = torch.cat([model.log_density(p) for p in pts.split(40_000)]).view(401, 401)
    m = log_p.max()
    dx = (grid[1] - grid[0]).item()
    quad = (m + torch.trapezoid(torch.trapezoid((log_p - m).exp(), dx=dx, dim=1), dx=dx).log()).item()
    log_z, se = model.log_partition(n_samples=200_000, chunk=20_000, generator=torch.Generator().manual_seed(5))
    assert 1e-4 < se < 0.02 and abs(log_z - quad) < 3 * se
    x = _data(n=4, dim=2)
    assert torch.allclose(model.log_likelihood(x, log_z), model.log_density(x) - log_z)


def test_log_partition_does_not_depend_on_chunk():
    model = _bumpy_2d_model()
    whole = model.log_partition(n_samples=5000, chunk=5000, generator=torch.Generator().manual_seed(9))
    parts = model.log_partition(n_samples=5000, chunk=777, generator=torch.Generator().manual_seed(9))
    assert whole[0] == pytest.approx(parts[0], abs=1e-12) and whole[1] == pytest.approx(parts[1], rel=1e-9)


def test_log_partition_stderr_matches_spread():
    model = _bumpy_2d_model()
    runs = [model.log_partition(n_samples=2000, chunk=1000, proposal_std=3.0,
                                generator=torch.Generator().manual_seed(100 + i)) for i in range(20)]
    estimates, stderrs = torch.tensor([r[0] for r in runs]), torch.tensor([r[1] for r in runs])
    ratio = estimates.std().item() / stderrs.mean().item()
    assert 0.6 < ratio < 1.6, ratio


def test_mixture_proposal_is_a_density_and_draws_from_it():
    points = torch.tensor([[3.0, -1.0], [-2.0, 4.0], [0.5, 0.5]], dtype=F64)
    q = ImportanceProposal(2, 2.0, points)
    grid = torch.linspace(-16, 16, 641, dtype=F64)
    dens = q.log_prob(torch.cartesian_prod(grid, grid)).exp().view(641, 641)
    dx = (grid[1] - grid[0]).item()
    assert torch.trapezoid(torch.trapezoid(dens, dx=dx, dim=1), dx=dx).item() == pytest.approx(1.0, abs=1e-6)
    x = q.draw(200_000, torch.Generator().manual_seed(0), F64, torch.device("cpu"))
    # closed-form moments of the mixture: E x = mean(points) / 2, E |x|^2 = (D std^2 + mean |p|^2 + D h^2) / 2
    h2 = q.bandwidth**2
    mean = points.mean(0) / 2
    second = (2 * 4.0 + points.pow(2).sum(1).mean() + 2 * h2) / 2
    assert torch.allclose(x.mean(0), mean, atol=4 * x.std(0).max().item() / math.sqrt(len(x)))
    sq = x.pow(2).sum(1)
    assert abs(sq.mean() - second) < 4 * sq.std() / math.sqrt(len(x))


def test_mixture_proposal_gives_log_z_with_more_effective_draws():
    # alpha = 0 and a narrow base N(0, 0.3^2 I) in 5-D: Z in closed form, and the broad N(0, 4 I) rarely draws there
    dim, std, n = 5, 0.3, 20_000
    model = _model(dim=dim, n_centres=4, q0_std=std)
    truth = 0.5 * dim * math.log(2 * math.pi * std**2)
    points = std * torch.randn(200, dim, dtype=F64, generator=torch.Generator().manual_seed(1))  # "training data"
    with pytest.warns(RuntimeWarning, match="effective sample size"):
        broad = model.log_partition(n_samples=n, chunk=5000, generator=torch.Generator().manual_seed(3))
    mixed = model.log_partition(n_samples=n, chunk=5000, generator=torch.Generator().manual_seed(3),
                                proposal_points=points)
    assert abs(mixed[0] - truth) < 3 * mixed[1] < 0.1
    assert effective_sample_size(broad[1], n) < 100 < 500 < effective_sample_size(mixed[1], n)
    # independent of the chunk, as the broad proposal
    parts = model.log_partition(n_samples=n, chunk=777, generator=torch.Generator().manual_seed(3),
                                proposal_points=points)
    assert parts[0] == pytest.approx(mixed[0], abs=1e-12)


def test_mixture_proposal_refuses_points_of_another_dimension():
    with pytest.raises(ValueError, match=r"proposal_points: expected \[n >= 1, 2\]"):
        _bumpy_2d_model().log_partition(n_samples=10, proposal_points=torch.zeros(4, 3, dtype=F64))


def test_log_partition_warns_on_few_effective_samples():
    model = _bumpy_2d_model()
    with pytest.warns(RuntimeWarning, match="effective sample size .* standard error"):
        model.log_partition(n_samples=50, chunk=20, generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------ (4) training through the solve


@pytest.mark.parametrize("feature_net", NETS)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_two_stage_objective_trains_every_parameter(feature_net, objective):
    model, x = _model(feature_net), _data(n=12)
    alpha = model.solve_alpha(x[:6], objective, sigma=SIGMA)
    loss = exact_score_matching(lambda z: model.score(z, alpha), x[6:]).mean()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert sum(isinstance(m, DEQ) for m in model.modules()) == (3 if feature_net == "deq" else 0)


def test_deq_feature_net_solves_its_fixed_point():
    model, x = _model("deq", hidden=8), _data(n=7)
    body = model.features[1].body
    with torch.no_grad():
        body.deq.func.lin.weight.mul_(50.0)  # the normaliser must undo any weight scale
        u, z = body.injection(x), body(x)
        w_scaled = body.deq.func.scaled_weight()
    assert torch.allclose(z, z @ w_scaled.T + u, atol=1e-11)
    assert torch.linalg.matrix_norm(w_scaled, ord=2) < 1
    phi = model.features[1](x)
    assert torch.allclose(phi, z + model.features[1].skip(x))


@pytest.mark.parametrize("through", [True, False])
def test_grad_through_norm(through):
    fmap = DKEFDEQMap(6, grad_through_norm=through).double()
    r = torch.randn(6, 6, dtype=F64)
    (g,) = torch.autograd.grad((fmap.scaled_weight() * r).sum(), fmap.lin.weight)
    w = fmap.lin.weight.detach()
    if through:  # W / ||W|| is scale-invariant: its gradient is orthogonal to W
        assert abs((g * w).sum().item()) < 1e-5 * g.norm().item() * w.norm().item()
    else:
        assert torch.allclose(g, r / ((1 + 1e-6) * (w.norm() + 1e-6)))


# ------------------------------------------------------------------ (5) errors


def test_singular_system_names_log_lambda():
    model, x = _model(log_lambda=-40.0), _data(n=6)
    with torch.no_grad():
        model.centres[1] = model.centres[0]  # duplicated centre: G has two equal rows and columns
    with pytest.raises(ValueError, match=r"log_lambda = -40.*increase log_lambda"):
        model.solve_alpha(x, "exact")
    with torch.no_grad():
        model.log_lambda.fill_(-2.0)
    assert torch.isfinite(model.solve_alpha(x, "exact")).all()


def test_alpha_from_fixed_system_tunes_log_lambda():
    model, x = _model(), _data()
    gram, b = model.alpha_system(x, "exact", create_graph=False)
    alpha = model.alpha_from_system(gram, b)
    assert torch.allclose(alpha, model.solve_alpha(x, "exact"), atol=1e-12)
    (g,) = torch.autograd.grad(alpha.pow(2).sum(), model.log_lambda)
    assert g.item() < 0  # a larger ridge shrinks alpha
    with pytest.raises(ValueError, match="alpha system must be"):
        model.alpha_from_system(gram[:2, :2], b[:2])


@pytest.mark.parametrize(("kw", "match"), [
    ({"feature_net": "wide"}, "feature_net"),
    ({"dim": 0}, "dim"),
    ({"n_centres": 0}, "n_centres"),
    ({"hidden": 2.5}, "hidden"),
    ({"deep_layers": 1}, "deep_layers"),
    ({"q0_std": -1.0}, "q0_std"),
    ({"log_lambda": math.nan}, "log_lambda"),
    ({"kernel_log_scales": (0.0, 1.0)}, "kernel_log_scales"),
    ({"kernel_log_scales": (0.0, 1.0, math.inf)}, "kernel_log_scales"),
    ({"bandwidth_init": "mean"}, "bandwidth_init"),
    ({"bandwidth_points": 0}, "bandwidth_points"),
    ({"feature_net": "deq", "deq": partial(DEQ, backward="ift")}, "ift"),
])
def test_bad_options_raise_config_error(kw, match):
    opts = {"dim": 3, "n_centres": 4, "hidden": 5} | kw
    with pytest.raises(ConfigError, match=match):
        DKEF(**opts)


def test_bad_call_arguments():
    model, x = _model(), _data()
    with pytest.raises(ValueError, match="objective"):
        model.alpha_system(x, "hutchinson")
    with pytest.raises(ValueError, match="sigma"):
        model.alpha_system(x, "dsm")
    with pytest.raises(ValueError, match="projection"):
        model.alpha_system(x, "sliced", projection="cube")
    with pytest.raises(ValueError, match="projections"):
        model.alpha_system(x, "sliced", projections=torch.randn(2, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"shape \[B, 3\]"):
        model.kernel(torch.randn(4, 2, dtype=F64))
    with pytest.raises(ValueError, match="non-finite"):
        model.alpha_system(torch.full((4, 3), math.nan, dtype=F64), "exact")
    with pytest.raises(ValueError, match="alpha must have shape"):
        model.log_density(x, torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="n_centres=5"):
        model.init_centres(x[:3])
    with pytest.raises(ValueError, match="n_samples"):
        model.log_partition(n_samples=1)


@pytest.mark.parametrize("feature_net", NETS)
def test_second_derivatives_at_the_centres_match_the_plain_kernel(feature_net):
    # Centres are drawn from the training data, so the model is evaluated at its own centres, where the expanded
    # squared distance |f|^2 + |c|^2 - 2 f.c rounds to about zero (often below it, in float32 as in training).
    model = _model(feature_net, dim=4, n_centres=8, hidden=16).float()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.centres.copy_(x)
        model.alpha.copy_(torch.randn(8, generator=torch.Generator().manual_seed(4)))

    def laplacian(log_density, z):
        return torch.autograd.functional.hessian(log_density, z).diagonal().sum()

    for z in x:
        ours = laplacian(lambda y: model.log_density(y[None])[0], z)
        plain = laplacian(lambda y: model.q0(y[None])[0] + _plain_kernel(model, y) @ model.alpha, z)
        torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("config", "expected_terms"), [("deq.yaml", 2), ("deq_reference.yaml", 3)])
def test_dkef_deq_configs_truncate_the_neumann_series_as_documented(config, expected_terms):
    # the DEQ feature map is linear, z = W~ z + u: K steps from the detached fixed point give dz/du = sum_{k<K} W~^k,
    # and the reference's injection-only pre-step adds one term (docs/method.md 2.5)

    from deqscore.lightning import build_module

    cfg = load_config(f"configs/dkef/{config}")["model"]
    cfg["init_args"]["net"]["init_args"].update(dim=3, n_centres=4, hidden=5)
    body = build_module(cfg).net.features[0].body.double()
    u = torch.randn(2, 5, dtype=F64, requires_grad=True)
    z = body.deq(u)
    jac = torch.stack([torch.autograd.grad(z[0, i], u, retain_graph=True)[0][0] for i in range(5)])
    w = body.deq.func.scaled_weight().detach()
    expected = sum(torch.linalg.matrix_power(w, k) for k in range(expected_terms))
    torch.testing.assert_close(jac, expected)


def test_effective_sample_size_is_recovered_from_the_reported_standard_error():
    """Against ESS = (sum w)^2 / sum w^2 of explicit weights, through the standard error the summary reports."""
    from deqscore.models.dkef import _is_summary, effective_sample_size

    log_w = torch.randn(500, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1.5
    w = log_w.exp()
    direct = (w.sum() ** 2 / (w**2).sum()).item()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _, stderr = _is_summary(torch.logsumexp(log_w, 0).item(), torch.logsumexp(2 * log_w, 0).item(), 500)
    assert effective_sample_size(stderr, 500) == pytest.approx(direct, rel=1e-9)
    assert direct < 400  # the weights are uneven: the test is not the trivial ESS = n


def test_a_chunked_graph_free_system_is_the_whole_batchs():
    """Chunks of rows accumulate the same batch means (the exact objective has no random draws to differ)."""
    model, x = _model("deq"), torch.cat([_data(), _data() + 0.5])
    whole = model.alpha_system(x, "exact", create_graph=False)
    chunked = model.alpha_system(x, "exact", create_graph=False, chunk=3)
    assert all(torch.allclose(w, c, rtol=1e-10, atol=1e-12) for w, c in zip(whole, chunked, strict=True))


@pytest.mark.parametrize(("weighting", "power"), [("none", -4), ("sigma2", -2), ("sigma4", 0)])
def test_the_dsm_system_is_that_of_the_losss_weighting(weighting, power):
    """The system of the sigma^4-weighted DSM loss, rescaled by sigma^(power) for the loss's own weighting (the
    brute-force rows above check the sigma^4 system itself)."""
    model, x = _model(), _data()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    base = model.alpha_system(x, "dsm", sigma=SIGMA, noise=noise)
    weighted = model.alpha_system(x, "dsm", sigma=SIGMA, noise=noise, dsm_weighting=weighting)
    assert all(torch.allclose(w, SIGMA**power * b, rtol=1e-12) for w, b in zip(weighted, base, strict=True))
