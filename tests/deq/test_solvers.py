import math

import pytest
import torch

from deqscore.deq import available_solvers, get_solver, register_solver
from deqscore.deq.solvers import NonFiniteIterateError, check_stopping, picard
from deqscore.errors import ConfigError

from .helpers import TanhMap

SOLVERS = ["picard", "anderson", "broyden"]


def _reference_fixed_point(f, u, n=400):
    z = torch.zeros_like(u)
    for _ in range(n):
        z = f(z, u)
    return z


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("stop_mode", ["abs", "rel"])
def test_solver_reaches_long_iteration_fixed_point(solver, per_sample, stop_mode):
    f = TanhMap(20, rho=0.8)
    u = torch.randn(6, 20, dtype=torch.float64)
    ref = _reference_fixed_point(f, u)
    with torch.no_grad():
        z, stats = get_solver(solver)(
            lambda z: f(z, u), torch.zeros_like(u), tol=1e-10, max_iter=300,
            stop_mode=stop_mode, per_sample=per_sample,
        )
    assert stats.converged
    assert torch.allclose(z, ref, atol=1e-8)
    # the reported residual is the one of the returned point's preimage, below tol
    assert (stats.abs_residual if stop_mode == "abs" else stats.rel_residual) < 1e-10


def test_accelerated_solvers_need_fewer_evaluations_than_picard():
    # symmetric linear map with eigenvalues spread over [0, 0.95]: Picard contracts at rate 0.95
    q, _ = torch.linalg.qr(torch.randn(50, 50, dtype=torch.float64))
    a = q @ torch.diag(torch.linspace(0, 0.95, 50, dtype=torch.float64)) @ q.T
    u = torch.randn(8, 50, dtype=torch.float64)
    nsteps = {}
    with torch.no_grad():
        for name in SOLVERS:
            _, stats = get_solver(name)(lambda z: z @ a + u, torch.zeros_like(u), tol=1e-9, max_iter=1000)
            assert stats.converged
            nsteps[name] = stats.nstep
    assert nsteps["anderson"] < nsteps["picard"] / 2
    assert nsteps["broyden"] < nsteps["picard"] / 2


def test_per_sample_stopping_waits_for_the_slowest_sample():
    # sample 0 converges in one step (f constant), sample 1 contracts slowly
    def f(z):
        return torch.stack([torch.ones_like(z[0]), 0.9 * z[1] + 0.1])

    z0 = torch.zeros(2, 3, dtype=torch.float64)
    _, batch = picard(f, z0, tol=1e-3, max_iter=500, per_sample=True)
    residual_sample1 = (0.9 ** batch.nstep) * 0.1 * 3**0.5  # closed-form residual of sample 1
    assert batch.converged and residual_sample1 < 1e-3
    expected_steps = math.ceil(math.log(1e-3 / (0.1 * 3**0.5)) / math.log(0.9)) + 1
    assert batch.nstep == expected_steps


def test_nonfinite_iterate_raises():
    with pytest.raises(NonFiniteIterateError, match="non-finite"):
        picard(lambda z: 2 * z + float("nan"), torch.zeros(2, 2), tol=1e-6, max_iter=5)


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize(
    ("tol", "message"),
    [(float("nan"), "DEQ tol must be finite, got nan"), (float("inf"), "DEQ tol must be finite, got inf"),
     (0.0, "DEQ tol must be positive, got 0.0"), (None, "DEQ tol must be a number, got None")],
)
def test_stopping_check_refuses_a_tolerance_that_is_not_finite_and_positive(solver, tol, message):
    with pytest.raises(ConfigError, match=message):
        get_solver(solver)(lambda z: 0.5 * z, torch.zeros(2, 2), tol=tol, max_iter=5)


def test_stopping_check_refuses_an_unknown_mode():
    with pytest.raises(ConfigError, match="unknown DEQ stop_mode 'max'; accepted: 'abs', 'rel'"):
        check_stopping(1e-5, "max")


def test_stats_report_nonconvergence():
    _, stats = picard(lambda z: 0.999 * z + 1, torch.zeros(1, 1, dtype=torch.float64), tol=1e-9, max_iter=5)
    assert not stats.converged and stats.nstep == 5
    # z_4 = (1 - 0.999^4) / 0.001, so the last residual f(z_4) - z_4 = 0.999^4
    assert stats.abs_residual == pytest.approx(0.999**4, rel=1e-9)


def test_registry_rejects_unknown_and_accepts_new_solvers():
    with pytest.raises(ValueError, match="accepted: .*anderson"):
        get_solver("newton-krylov")
    name = "half-picard-test"
    if name not in available_solvers():

        @register_solver(name)
        def half(f, z0, *, tol, max_iter, stop_mode="abs", per_sample=False):
            return picard(lambda z: 0.5 * (f(z) + z), z0, tol=tol, max_iter=max_iter,
                          stop_mode=stop_mode, per_sample=per_sample)

    z, stats = get_solver(name)(lambda z: 0.5 * z + 1, torch.zeros(1, 1), tol=1e-10, max_iter=200)
    assert stats.converged and torch.allclose(z, torch.full((1, 1), 2.0))
    with pytest.raises(ValueError, match="already registered"):
        register_solver("picard")(picard)


@pytest.mark.parametrize("solver", SOLVERS)
def test_float32_solvers_reach_tolerances_near_rounding_level(solver):
    # a strongly contracting map around a large iterate (||z|| ~ 1e3, as the NICE m-net on logit inputs): the
    # tolerance is a relative 2e-8, below float32's eps. Picard lands on the float fixed point; an Anderson
    # mixing written as a plain weighted sum of images stalls at ~eps ||z||.
    torch.manual_seed(0)
    w = torch.randn(256, 256) / 256
    u = torch.randn(128, 256) * 4
    f = lambda z: 1e-3 * torch.nn.functional.softplus(z @ w) + u  # noqa: E731
    tol = 2e-8 * u.norm().item()
    with torch.no_grad():
        _, stats = get_solver(solver)(f, torch.zeros_like(u), tol=tol, max_iter=50)
    assert stats.converged and stats.nstep <= 6, stats


def test_anderson_keeps_pace_with_picard_on_strongly_contracting_maps():
    # first residual ~1e3, contraction ~1e-2: a ridge scaled by the old, large residuals would swamp the recent
    # ones and stall the mixing for several iterations
    torch.manual_seed(0)
    w = torch.randn(200, 200, dtype=torch.float64)
    w = w / torch.linalg.matrix_norm(w, ord=2) * 0.02
    u = torch.randn(64, 200, dtype=torch.float64) * 10
    f = lambda z: torch.tanh(z @ w) + u  # noqa: E731
    with torch.no_grad():
        picard_stats = get_solver("picard")(f, torch.zeros_like(u), tol=1e-12, max_iter=100)[1]
        anderson_stats = get_solver("anderson")(f, torch.zeros_like(u), tol=1e-12, max_iter=100)[1]
    assert picard_stats.converged and anderson_stats.converged
    assert anderson_stats.nstep <= picard_stats.nstep, (anderson_stats.history, picard_stats.history)


def test_anderson_survives_samples_that_converge_exactly():
    # float32 with an unreachable tolerance: samples reach f(z) == z exactly and their mixing systems go singular
    torch.manual_seed(0)
    w = torch.randn(8, 8) * 0.1
    u = torch.randn(64, 8)
    f = lambda z: torch.tanh(z @ w) + u  # noqa: E731
    with torch.no_grad():
        z, stats = get_solver("anderson")(f, torch.zeros_like(u), tol=1e-12, max_iter=60)
    assert torch.isfinite(z).all() and (f(z) - z).abs().max() < 1e-5
