import re

import pytest
import torch
from torch import nn

from deqscore.errors import ConfigError
from deqscore.losses import (
    DSM,
    SSM,
    SSMVR,
    AnnealedFDSSM,
    AnnealedLoss,
    AnnealedSSMVR,
    ScoreLoss,
    annealed_dsm,
    annealed_fd_ssm,
    annealed_ssm_vr,
    build_loss,
    denoising_score_matching,
    exact_score_matching,
    geometric_sigmas,
    loss_names,
    score_from_energy,
    score_from_log_prob,
    sliced_score_matching,
)

D = 5


@pytest.fixture
def gaussian():
    """Gaussian model s(x) = -P (x - mu) with a random SPD precision P."""
    a = torch.randn(D, D, dtype=torch.float64)
    p = a @ a.T / D + torch.eye(D, dtype=torch.float64)
    mu = torch.randn(D, dtype=torch.float64)
    return p, mu, (lambda x: -(x - mu) @ p)


def _exact_closed_form(p, mu, x):
    return 0.5 * ((x - mu) @ p).pow(2).sum(1) - torch.trace(p)


def test_exact_sm_gaussian_closed_form(gaussian):
    p, mu, score = gaussian
    x = torch.randn(7, D, dtype=torch.float64)
    assert torch.allclose(exact_score_matching(score, x), _exact_closed_form(p, mu, x))


def test_exact_sm_matches_finite_difference_hessian_trace_on_mlp():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(D, 16), nn.Softplus(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    logp = lambda x: net(x).squeeze(-1)  # noqa: E731
    x = torch.randn(4, D, dtype=torch.float64)
    got = exact_score_matching(score_from_log_prob(logp), x)
    h = 1e-4
    for b in range(x.shape[0]):
        xb = x[b : b + 1]
        f0 = logp(xb)
        grad = torch.stack([(logp(xb + h * e) - logp(xb - h * e)) / (2 * h) for e in torch.eye(D, dtype=x.dtype)])
        lap = sum((logp(xb + h * e) - 2 * f0 + logp(xb - h * e)) / h**2 for e in torch.eye(D, dtype=x.dtype))
        expected = 0.5 * grad.pow(2).sum() + lap
        assert got[b].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)


def test_exact_sm_works_on_image_shaped_input():
    x = torch.randn(3, 2, 2, 2, dtype=torch.float64)
    loss = exact_score_matching(lambda x: -2 * x, x)
    assert torch.allclose(loss, 0.5 * 4 * x.flatten(1).pow(2).sum(1) - 2 * 8)


@pytest.mark.parametrize("projection", ["rademacher", "gaussian", "sphere"])
@pytest.mark.parametrize("vr", [False, True])
def test_sliced_sm_is_unbiased_for_exact_sm(gaussian, projection, vr):
    p, mu, score = gaussian
    x = torch.randn(3, D, dtype=torch.float64)
    n = 20000
    loss = sliced_score_matching(score, x, n_projections=n, projection=projection, variance_reduction=vr)
    expected = _exact_closed_form(p, mu, x)
    # standard error of the Monte-Carlo mean from the per-projection spread of v^T P v and (v.s)^2
    tol = 6 * (p.norm() * (1 + ((x - mu) @ p).norm(dim=1) ** 2)) / n**0.5
    assert ((loss - expected).abs() < tol).all(), (loss, expected, tol)


def test_ssm_vr_has_lower_variance_than_ssm(gaussian):
    _, _, score = gaussian
    x = torch.randn(1, D, dtype=torch.float64).repeat(4000, 1)
    var_ssm = sliced_score_matching(score, x).var()
    var_vr = sliced_score_matching(score, x, variance_reduction=True).var()
    assert var_vr < var_ssm


def _dsm_expectation(p, s_x, sigma, weighting):
    # E 0.5||sigma s(x + sigma eps) + eps||^2 = 0.5 sigma^2 ||s(x)||^2 + 0.5 tr((I - sigma^2 P)^2), times sigma^(p-2)
    m = torch.eye(D, dtype=torch.float64) - sigma**2 * p
    sigma2 = 0.5 * sigma**2 * s_x.pow(2).sum() + 0.5 * torch.trace(m @ m)
    return sigma2 * sigma ** {"none": -2, "sigma2": 0, "sigma4": 2}[weighting]


@pytest.mark.parametrize("weighting", ["none", "sigma2", "sigma4"])
def test_dsm_gaussian_closed_form_expectation(gaussian, weighting):
    p, mu, score = gaussian
    sigma = 0.3
    x = torch.randn(1, D, dtype=torch.float64).repeat(200000, 1)
    loss = denoising_score_matching(score, x, sigma, weighting=weighting).mean()
    expected = _dsm_expectation(p, score(x[:1]), sigma, weighting)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-2)


def test_dsm_per_sample_sigma():
    x = torch.randn(4, D, dtype=torch.float64)
    sig = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    torch.manual_seed(5)
    per = denoising_score_matching(lambda x: -x, x, sig)
    for i in range(4):
        torch.manual_seed(5)
        eps = torch.randn_like(x)[i]
        xt = x[i] + sig[i] * eps
        assert per[i].item() == pytest.approx((0.5 * (sig[i] * -xt + eps).pow(2).sum()).item())


def test_score_from_energy_sign():
    x = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    s = score_from_energy(lambda x: 0.5 * (x**2).sum(1))(x)
    assert torch.allclose(s, -x)


def _gauss_cond(p):
    # noise-conditional Gaussian score of N(0, P^-1 + sigma^2 I)
    def score(x, sigma):
        cov = torch.linalg.inv(p) + sigma.view(-1, 1, 1) ** 2 * torch.eye(D, dtype=x.dtype)
        return -torch.linalg.solve(cov, x.unsqueeze(-1)).squeeze(-1)

    return score


def test_annealed_dsm_closed_form(gaussian):
    p, _, _ = gaussian
    sigmas = geometric_sigmas(1.0, 0.1, 3)
    score = _gauss_cond(p)
    x = torch.randn(1, D, dtype=torch.float64).repeat(100000, 1)
    labels = torch.full((x.shape[0],), 1)
    loss = annealed_dsm(score, x, sigmas, labels).mean()
    sig = sigmas[1].item()
    a = torch.linalg.inv(torch.linalg.inv(p) + sig**2 * torch.eye(D, dtype=torch.float64))
    m = torch.eye(D, dtype=torch.float64) - sig**2 * a
    # E 0.5 ||sigma s(x~) + eps||^2 with s linear: 0.5 sigma^2 ||A x||^2 + 0.5 tr((I - sigma^2 A)^2)
    expected = 0.5 * sig**2 * (x[0] @ a).pow(2).sum() + 0.5 * torch.trace(m @ m)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-2)


@pytest.mark.parametrize("loss_fn", [annealed_ssm_vr, annealed_fd_ssm])
def test_annealed_sliced_losses_equal_weighted_exact_sm_for_linear_scores(gaussian, loss_fn):
    p, _, _ = gaussian
    sigmas = geometric_sigmas(1.0, 0.1, 3)
    score = _gauss_cond(p)
    torch.manual_seed(11)
    x = torch.randn(1, D, dtype=torch.float64).repeat(40000, 1)
    labels = torch.full((x.shape[0],), 2)
    loss = loss_fn(score, x, sigmas, labels).mean()
    # same noise draws, exact SM of the linear score at the noisy points
    torch.manual_seed(11)
    sig = sigmas[2].item()
    xt = x + sig * torch.randn_like(x)
    a = torch.linalg.inv(torch.linalg.inv(p) + sig**2 * torch.eye(D, dtype=torch.float64))
    expected = ((0.5 * (xt @ a).pow(2).sum(1) - torch.trace(a)) * sig**2).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=3e-2, abs=3e-2 * sig**2 * torch.trace(a).item())


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, D)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        exact_score_matching(lambda x: -x, bad)
    with pytest.raises(ValueError, match="shape of x"):
        sliced_score_matching(lambda x: -x[:, :2], x)
    w = nn.Parameter(torch.ones(D))
    with pytest.raises(ValueError, match="does not depend on x"):
        sliced_score_matching(lambda x: w.expand_as(x), x)
    with pytest.raises(ValueError, match="does not depend on x"):
        exact_score_matching(lambda x: w.expand_as(x) * 1.0, x)
    with pytest.raises(ValueError, match="does not depend on x"):
        exact_score_matching(lambda x: torch.zeros_like(x), x)
    with pytest.raises(ValueError, match="unknown projection"):
        sliced_score_matching(lambda x: -x, x, projection="uniform")
    with pytest.raises(ValueError, match="unknown DSM weighting"):
        denoising_score_matching(lambda x: -x, x, 0.1, weighting="sigma3")


NAN, INF = float("nan"), float("inf")
SIGMAS = geometric_sigmas(1.0, 0.1, 3)


def _object_loss(name: str):
    loss = build_loss(name)
    if isinstance(loss, AnnealedLoss):
        return lambda x: loss(lambda x, s: -x, x, SIGMAS)
    return lambda x: loss(lambda x: -x, x)


LOSSES = {  # every loss, as a function of x: the functional forms and every registered loss object
    "exact": lambda x: exact_score_matching(lambda x: -x, x),
    "ssm": lambda x: sliced_score_matching(lambda x: -x, x),
    "ssm_vr": lambda x: sliced_score_matching(lambda x: -x, x, n_projections=2, variance_reduction=True),
    "dsm": lambda x: denoising_score_matching(lambda x: -x, x, 0.1),
    "annealed_dsm": lambda x: annealed_dsm(lambda x, s: -x, x, SIGMAS),
    "annealed_ssm_vr": lambda x: annealed_ssm_vr(lambda x, s: -x, x, SIGMAS),
    "annealed_fd_ssm": lambda x: annealed_fd_ssm(lambda x, s: -x, x, SIGMAS),
    **{f"object {name}": _object_loss(name) for name in loss_names(ScoreLoss, AnnealedLoss)},
}


@pytest.mark.parametrize("shape", [(5,), (), (4, 0)])
@pytest.mark.parametrize("loss", LOSSES.values(), ids=LOSSES.keys())
def test_every_loss_requires_a_batch_with_features(loss, shape):
    expected = f"x must have shape [B, ...] (a batch dimension and at least one feature), got {shape}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        loss(torch.randn(shape, dtype=torch.float64))


@pytest.mark.parametrize("loss", LOSSES.values(), ids=LOSSES.keys())
def test_every_loss_checks_its_input_is_finite_floating_point(loss):
    x = torch.randn(4, D, dtype=torch.float64)
    x[1, 2] = NAN
    with pytest.raises(ValueError, match="x contains 1 non-finite values"):
        loss(x)
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got torch.int64"):
        loss(torch.ones(4, D, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        loss([[1.0, 2.0]])


def test_batch_shaped_inputs_of_any_rank_are_accepted():
    x = torch.randn(3, 2, 2, dtype=torch.float64)
    assert exact_score_matching(lambda x: -x, x).shape == (3,)
    assert sliced_score_matching(lambda x: -x, x, n_projections=2).shape == (3,)
    assert exact_score_matching(lambda x: -x, torch.randn(3, 1)).shape == (3,)


@pytest.mark.parametrize(
    ("sigma", "message"),
    [(NAN, "DSM sigma must be finite, got nan"), (INF, "DSM sigma must be finite, got inf"),
     (0.0, "DSM sigma must be positive, got 0.0"), (-0.1, "DSM sigma must be positive"),
     ("0.1", "DSM sigma must be a number, got '0.1'"),
     (torch.tensor([0.1, NAN, 0.2, 0.3]), "DSM sigma must be finite and positive, got 1 noise levels that are not"),
     (torch.tensor([0.1, INF, 0.0, 0.3]), "DSM sigma must be finite and positive, got 2 noise levels that are not"),
     (torch.tensor(NAN), "DSM sigma must be finite and positive, got 4 noise levels"),
     (torch.ones(3), r"DSM sigma must be a float or a \[B\] tensor, got shape \(3,\)")],
)
def test_dsm_sigma_must_be_finite_and_positive(sigma, message):
    with pytest.raises(ValueError, match=message):
        denoising_score_matching(lambda x: -x, torch.randn(4, D), sigma)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, s: sliced_score_matching(lambda x: -x, x, n_projections=0), "n_projections must be >= 1, got 0"),
        (lambda x, s: sliced_score_matching(lambda x: -x, x, n_projections=1.0), "n_projections must be an int"),
        (lambda x, s: annealed_ssm_vr(lambda x, s: -x, x, s, n_projections=0), "n_projections must be >= 1"),
        (lambda x, s: annealed_ssm_vr(lambda x, s: -x, x, s, n_projections=True), "n_projections must be an int"),
        (lambda x, s: annealed_fd_ssm(lambda x, s: -x, x, s, fd_eps=NAN), "fd_eps must be finite, got nan"),
        (lambda x, s: annealed_fd_ssm(lambda x, s: -x, x, s, fd_eps=INF), "fd_eps must be finite, got inf"),
        (lambda x, s: annealed_fd_ssm(lambda x, s: -x, x, s, fd_eps=0.0), "fd_eps must be positive, got 0.0"),
        (lambda x, s: annealed_dsm(lambda x, s: -x, x, s.clone().fill_(NAN)), "sigmas must be finite and positive"),
        (lambda x, s: annealed_dsm(lambda x, s: -x, x, -s), "sigmas must be finite and positive, got 3 noise"),
        (lambda x, s: annealed_dsm(lambda x, s: -x, x, s[:0]), r"sigmas must be a non-empty 1-D tensor.*\(0,\)"),
        (lambda x, s: annealed_dsm(lambda x, s: -x, x, s[0]), r"sigmas must be a non-empty 1-D tensor.*\(\)"),
    ],
)
def test_functional_options_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(4, D, dtype=torch.float64), geometric_sigmas(1.0, 0.1, 3))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        *[(lambda v=v: DSM(sigma=v), f"DSM sigma must be finite, got {v}") for v in (NAN, INF, -INF)],
        (lambda: DSM(sigma=0.0), "DSM sigma must be positive, got 0.0"),
        (lambda: DSM(sigma=True), "DSM sigma must be a number, got True"),
        *[(lambda v=v: AnnealedFDSSM(fd_eps=v), f"fd_eps must be finite, got {v}") for v in (NAN, INF)],
        (lambda: AnnealedFDSSM(fd_eps=-0.1), "fd_eps must be positive, got -0.1"),
        *[(lambda c=c, v=v: c(n_projections=v), f"n_projections must be >= 1, got {v}")
          for c in (SSM, SSMVR, AnnealedSSMVR) for v in (0, -2)],
        *[(lambda c=c, v=v: c(n_projections=v), f"n_projections must be an int >= 1, got {v!r}")
          for c in (SSM, SSMVR, AnnealedSSMVR) for v in (2.0, True, NAN)],
    ],
)
def test_loss_object_options_raise_config_error_naming_them(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_build_loss_by_name_or_object_and_clear_errors():
    assert type(build_loss("ssm")) is SSM and build_loss("ssm").n_projections == 1
    dsm = DSM(sigma=0.2, weighting="none")
    assert build_loss(dsm) is dsm and repr(dsm) == "DSM(sigma=0.2, weighting='none')"
    with pytest.raises(ConfigError, match="unknown model.loss 'nce'; accepted: 'exact', 'ssm'"):
        build_loss("nce", ScoreLoss, key="model.loss")
    with pytest.raises(ConfigError, match="unknown loss 'annealed_dsm'"):  # a name of another kind
        build_loss("annealed_dsm", ScoreLoss)
    with pytest.raises(ConfigError, match="a DSM does not fit here"):
        build_loss(dsm, AnnealedLoss)
    with pytest.raises(ConfigError, match="n_projections must be >= 1"):
        SSM(n_projections=0)
    with pytest.raises(ConfigError, match="unknown projection 'uniform'; accepted: 'rademacher'"):
        SSM(projection="uniform")
    with pytest.raises(ConfigError, match="unknown DSM weighting 'sigma3'"):
        DSM(weighting="sigma3")
    with pytest.raises(ConfigError, match="sigma must be positive"):
        DSM(sigma=0.0)


def _score_loss_reference(name, p, mu, x):
    """(loss object, expected mean over x, relative tolerance) of every registered ScoreLoss on a Gaussian."""
    exact = _exact_closed_form(p, mu, x[:1])[0]
    sigma = 0.3
    table = {
        "exact": (build_loss("exact"), exact, 1e-10),
        "ssm": (SSM(projection="gaussian"), exact, 3e-2),  # unbiased for exact SM
        "ssm_vr": (build_loss("ssm_vr"), exact, 3e-2),
        "dsm": (DSM(sigma=sigma, weighting="none"), _dsm_expectation(p, -(x[0] - mu) @ p, sigma, "none"), 2e-2),
    }
    if name not in table:
        pytest.fail(f"loss {name!r} is registered but has no closed-form reference in this test: add one")
    return table[name]


@pytest.mark.parametrize("name", loss_names(ScoreLoss))
def test_every_registered_score_loss_matches_its_gaussian_closed_form(gaussian, name):
    p, mu, score = gaussian
    torch.manual_seed(1)
    x = torch.randn(1, D, dtype=torch.float64).repeat(100000, 1)
    loss, expected, rel = _score_loss_reference(name, p, mu, x)
    got = loss(score, x).mean()
    assert got.item() == pytest.approx(expected.item(), rel=rel, abs=rel * torch.trace(p).item())


@pytest.mark.parametrize("name", loss_names(AnnealedLoss))
def test_every_registered_annealed_loss_matches_the_functional_form(gaussian, name):
    # the object's call is its function with the object's options, on the same random draws
    p, _, _ = gaussian
    sigmas = geometric_sigmas(1.0, 0.1, 3)
    x = torch.randn(64, D, dtype=torch.float64)
    fns = {"annealed_dsm": annealed_dsm, "annealed_ssm_vr": annealed_ssm_vr, "annealed_fd_ssm": annealed_fd_ssm}
    if name not in fns:
        pytest.fail(f"annealed loss {name!r} has no reference in this test: add one")
    torch.manual_seed(2)
    got = build_loss(name, AnnealedLoss)(_gauss_cond(p), x, sigmas)
    torch.manual_seed(2)
    assert torch.equal(got, fns[name](_gauss_cond(p), x, sigmas))
    assert build_loss(name).input_derivatives == (1 if name == "annealed_ssm_vr" else 0)
