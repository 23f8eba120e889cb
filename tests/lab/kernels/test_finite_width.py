"""Finite weight-tied DEQs built on deqscore's DEQ layer against the analytic kernels.

At sw2 = 0.5, su2 = 0.3, sb2 = 0.2 and each width N, independent seeds give the empirical NTK (exact implicit
gradient, ``backward="ift"``), the empirical NTK of K = 2 phantom steps (the same network and fixed point,
``backward="phantom"``) and the empirical NNGP. The seed mean must lie within 3 standard errors plus c / N of the
analytic value, and the spread across seeds (standard deviation, log-averaged over the entries) must shrink
like N^-1/2: the slope of log spread against log N in [-0.7, -0.3].

c = 32 allows for the O(1/N) bias of the mean: a finite ReLU network's expected NTK differs from its limit by a
relative O(depth / N) (the correction grows about like 5 L / N for depth L); the DEQ's effective depth here is
1 / (1 - sw2) = 2 and the kernel's scale Theta*(x, x) = 3, so c ~ 5 * 2 * 3 = 30. At N = 256 it allows 0.125 on
a diagonal of 3, at N = 1024 0.03, while a wrong closed form (e.g. the K = 2 phantom kernel in place of the exact
one, 0.5 lower on the diagonal) is several standard errors away at every width.

The default run uses widths 256-1024 with 20 seeds (about 10 s on one core); the issue's grid, widths 256-4096
with 10 seeds, is the ``slow`` test.
"""

import math

import pytest
import torch

from deqlab.kernels import FiniteDEQ, deq_nngp, deq_ntk, empirical_nngp, empirical_ntk

pytestmark = pytest.mark.xdist_group("finite_width")  # one worker runs the module, so its module fixture is built once

SW2, SU2, SB2 = 0.5, 0.3, 0.2
PHANTOM_K = 2
C_BIAS = 32.0


def inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(123)
    return torch.nn.functional.normalize(torch.randn(3, 4, generator=g, dtype=torch.float64), dim=1)


def sample(widths: list[int], seeds: int) -> dict[int, dict[str, torch.Tensor]]:
    """``{N: {"ift": [S, n, n], "phantom": [S, n, n], "nngp": [S, n, n]}}``."""
    torch.set_num_threads(1)
    X = inputs()
    out = {}
    for N in widths:
        kinds: dict[str, list[torch.Tensor]] = {"ift": [], "phantom": [], "nngp": []}
        for s in range(seeds):
            torch.manual_seed(10_000 * N + s)
            net = FiniteDEQ(N, X.shape[1], SW2, SU2, SB2, backward="ift", tol=1e-8, ift_tol=1e-9,
                            phantom_steps=PHANTOM_K)
            kinds["ift"].append(empirical_ntk(net, X))
            net.deq.backward = "phantom"
            kinds["phantom"].append(empirical_ntk(net, X))
            kinds["nngp"].append(empirical_nngp(net, X))
        out[N] = {k: torch.stack(v) for k, v in kinds.items()}
    return out


def analytic() -> dict[str, torch.Tensor]:
    X = inputs()
    return {"ift": deq_ntk(X, X, SW2, SU2, SB2), "phantom": deq_ntk(X, X, SW2, SU2, SB2, phantom_steps=PHANTOM_K),
            "nngp": deq_nngp(X, X, SW2, SU2, SB2)}


def assert_means_agree(samples: dict, kind: str, reference: torch.Tensor) -> None:
    for N, kinds in samples.items():
        draws = kinds[kind]
        mean, se = draws.mean(0), draws.std(0) / math.sqrt(len(draws))
        gap = (mean - reference).abs()
        allowed = 3 * se + C_BIAS / N
        assert (gap <= allowed).all(), f"{kind} N={N}: |mean - analytic| {gap.tolist()} > {allowed.tolist()}"


def spread_slope(samples: dict, kind: str) -> float:
    """Least-squares slope of the entry-averaged log standard deviation against log N."""
    iu = torch.triu_indices(3, 3)
    logn = torch.tensor([math.log(N) for N in samples], dtype=torch.float64)
    logsd = torch.stack([k[kind].std(0)[iu[0], iu[1]].log().mean() for k in samples.values()])
    x = logn - logn.mean()
    return float((x * (logsd - logsd.mean())).sum() / (x * x).sum())


@pytest.fixture(scope="module")
def small():
    return sample([256, 512, 1024], seeds=20)


@pytest.mark.parametrize("kind", ["ift", "phantom", "nngp"])
def test_seed_mean_matches_the_analytic_kernel(small, kind):
    assert_means_agree(small, kind, analytic()[kind])


def test_exact_and_phantom_kernels_are_told_apart(small):
    """The check has power: the exact-gradient draws do not match the phantom closed form, nor the reverse."""
    ref = analytic()
    widest = small[max(small)]
    for kind, other in (("ift", "phantom"), ("phantom", "ift")):
        draws = widest[kind]
        gap = (draws.mean(0) - ref[other]).diagonal().abs()
        assert (gap > 3 * draws.std(0).diagonal() / math.sqrt(len(draws)) + C_BIAS / max(small)).all()


@pytest.mark.parametrize("kind", ["ift", "phantom"])
def test_spread_shrinks_like_inverse_sqrt_width(small, kind):
    assert -0.7 <= spread_slope(small, kind) <= -0.3


@pytest.mark.slow
def test_issue_grid_widths_256_to_4096():
    samples = sample([256, 512, 1024, 2048, 4096], seeds=10)
    ref = analytic()
    for kind in ("ift", "phantom", "nngp"):
        assert_means_agree(samples, kind, ref[kind])
    for kind in ("ift", "phantom"):
        assert -0.7 <= spread_slope(samples, kind) <= -0.3


def _jacobian_norm_and_convergence(width: int, sw2: float, seed: int) -> tuple[float, bool]:
    """``||sqrt(sw2 / N) W diag(phi'(f*))||_2 / sigma_w`` at the (attempted) fixed point, and whether it was met."""
    torch.manual_seed(seed)
    net = FiniteDEQ(width, 4, sw2, 0.6 * (1 - sw2), 0.4 * (1 - sw2), warn_on_nonconvergence=False)
    x = torch.nn.functional.normalize(torch.randn(1, 4, dtype=torch.float64), dim=1)
    with torch.no_grad():
        f = net.deq(net.su * x @ net.U.T + net.sb * net.b)
        W = next(net.deq.func.parameters())
        J = math.sqrt(sw2 / width) * W * (f[0] > 0).to(W.dtype)[None, :]
        return float(torch.linalg.matrix_norm(J, ord=2)) / math.sqrt(sw2), bool(net.deq.stats.converged)


@pytest.mark.parametrize("sw2", [0.5, 0.95])
def test_finite_jacobian_norm_and_where_the_finite_solve_fails(sw2):
    """The figures of docs/method.md section 2.8 (ii): ||J||_2 = (1 + 1/sqrt 2) sigma_w (half the ReLU units active),
    and the finite DEQ is solved at sigma_w^2 = 0.5 but not at 0.95, a setting whose kernel deq_nngp computes."""
    runs = [_jacobian_norm_and_convergence(1024, sw2, seed) for seed in range(3)]
    assert all(norm == pytest.approx(1 + 2**-0.5, rel=0.03) for norm, _ in runs)
    assert [converged for _, converged in runs] == [sw2 < 0.9] * 3
