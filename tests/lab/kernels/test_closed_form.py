"""The closed-form DEQ kernels: the root, the diagonal, symmetry and PSD, the phantom form, the input checks."""

import math

import pytest
import torch

from deqlab.kernels import (
    deq_nngp,
    deq_ntk,
    finite_depth_kernels,
    fixed_point_correlation,
    k0,
    k1,
    normalised,
    ntk_diagonal,
)
from deqscore.errors import ConfigError

VARIANCES = [(0.5, 0.3, 0.2), (0.9, 0.05, 0.05), (0.1, 0.9, 0.0), (0.0, 0.5, 0.5), (0.99, 0.01, 0.0)]


def unit(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)


def picard_root(c: torch.Tensor, sw2: float, su2: float, sb2: float, steps: int = 5000) -> torch.Tensor:
    rho = torch.zeros_like(c)
    for _ in range(steps):
        rho = sw2 * k1(rho) + su2 * c + sb2
    return rho


@pytest.mark.parametrize("sw2,su2,sb2", VARIANCES)
def test_root_solves_the_fixed_point_equation(sw2, su2, sb2):
    c = torch.linspace(-1, 1, 201, dtype=torch.float64)
    rho = fixed_point_correlation(c, sw2, su2, sb2)
    assert rho.dtype == torch.float64
    assert (sw2 * k1(rho) + su2 * c + sb2 - rho).abs().max() < 1e-13
    assert torch.allclose(rho, picard_root(c, sw2, su2, sb2), atol=1e-10)


def test_float32_inputs_give_float64_kernels():
    X = unit(5, 7).float()
    X = X / X.norm(dim=1, keepdim=True)
    assert deq_ntk(X, X, 0.5, 0.3, 0.2).dtype == torch.float64
    assert deq_nngp(X, X, 0.5, 0.3, 0.2).dtype == torch.float64


@pytest.mark.parametrize("sw2,su2,sb2", VARIANCES)
@pytest.mark.parametrize("sv2", [1.0, 2.5])
def test_diagonal_is_the_closed_form(sw2, su2, sb2, sv2):
    X = unit(20, 6)
    assert torch.allclose(deq_ntk(X, X, sw2, su2, sb2, sv2).diagonal(), torch.full((20,), ntk_diagonal(sw2, sv2),
                          dtype=torch.float64), rtol=1e-12)
    assert torch.allclose(deq_nngp(X, X, sw2, su2, sb2, sv2).diagonal(), torch.full((20,), sv2, dtype=torch.float64))


def test_closed_form_at_orthogonal_inputs():
    # c = 0, sb2 = 0.2: rho solves 0.5 k1(rho) + 0.2 = rho, checked against an independent bisection
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        val = 0.5 * (math.sqrt(1 - mid**2) + (math.pi - math.acos(mid)) * mid) / math.pi + 0.2 - mid
        lo, hi = (mid, hi) if val > 0 else (lo, mid)
    rho = 0.5 * (lo + hi)
    kappa0 = (math.pi - math.acos(rho)) / math.pi
    kappa1 = (math.sqrt(1 - rho**2) + (math.pi - math.acos(rho)) * rho) / math.pi
    X = torch.eye(2, dtype=torch.float64)
    assert deq_nngp(X, X, 0.5, 0.3, 0.2)[0, 1].item() == pytest.approx(kappa1, abs=1e-13)
    expected = kappa1 + kappa0 * rho / (1 - 0.5 * kappa0)
    assert deq_ntk(X, X, 0.5, 0.3, 0.2)[0, 1].item() == pytest.approx(expected, abs=1e-13)


@pytest.mark.parametrize("sw2,su2,sb2", VARIANCES)
def test_gram_matrices_are_symmetric_psd(sw2, su2, sb2):
    X = unit(60, 5, seed=1)
    X = torch.cat([X, X[:3], -X[3:6]])  # repeated and opposite rows: the singular corners
    for K in (deq_ntk(X, X, sw2, su2, sb2), deq_nngp(X, X, sw2, su2, sb2),
              deq_ntk(X, X, sw2, su2, sb2, phantom_steps=2)):
        assert torch.equal(K, K.T)
        eig = torch.linalg.eigvalsh(K)
        assert eig.min() >= -1e-10 * eig.max()


def test_cross_kernel_matches_the_gram_blocks():
    X, Y = unit(4, 3, seed=2), unit(5, 3, seed=3)
    full = deq_ntk(torch.cat([X, Y]), torch.cat([X, Y]), 0.5, 0.3, 0.2)
    assert torch.allclose(deq_ntk(X, Y, 0.5, 0.3, 0.2), full[:4, 4:], atol=1e-14)


def decreasing(xs: list[float]) -> bool:
    return all(b < a for a, b in zip(xs, xs[1:], strict=False))


def test_phantom_kernel_truncates_the_neumann_series():
    X = unit(8, 4, seed=4)
    exact = deq_ntk(X, X, 0.7, 0.2, 0.1)
    rho = fixed_point_correlation((X @ X.T).clamp(-1, 1), 0.7, 0.2, 0.1)
    one = deq_ntk(X, X, 0.7, 0.2, 0.1, phantom_steps=1)
    assert torch.allclose(one, k1(rho) + k0(rho) * rho, atol=1e-12)  # K = 1: no propagation through W
    errors = [(deq_ntk(X, X, 0.7, 0.2, 0.1, phantom_steps=K) - exact).abs().max().item() for K in (1, 2, 4, 8, 16)]
    assert all(b < a for a, b in zip(errors, errors[1:], strict=False))
    assert errors[-1] < 0.7**16 * 10  # the bias decays like Sdot^K <= sw2^K
    diag = deq_ntk(X, X, 0.7, 0.2, 0.1, phantom_steps=3).diagonal()
    assert torch.allclose(diag, torch.full_like(diag, 1 + (1 - 0.7**3) / (1 - 0.7)))


def test_finite_depth_with_injection_converges_to_the_fixed_point():
    X = unit(10, 4, seed=5)
    depths = [1, 2, 4, 8, 16, 32, 64]
    out = finite_depth_kernels(X, X, depths, 0.5, 0.3, 0.2)
    nngp, ntk = deq_nngp(X, X, 0.5, 0.3, 0.2), deq_ntk(X, X, 0.5, 0.3, 0.2)
    err_gp = [(out[L][0] - nngp).abs().max().item() for L in depths]
    err_tk = [(out[L][1] - ntk).abs().max().item() for L in depths]
    assert all(b < a for a, b in zip(err_gp[:-2], err_gp[1:-1], strict=False))
    assert all(b < a for a, b in zip(err_tk[:-2], err_tk[1:-1], strict=False))
    assert err_gp[0] > 1e-3 and err_tk[0] > 1e-2  # shallow nets differ visibly
    assert err_gp[-1] < 1e-12 and err_tk[-1] < 1e-12


def test_deep_net_without_injection_forgets_its_input():
    """Without injection the NNGP's normalised off-diagonals go to 1 and the NTK's to one common value (a constant
    kernel: about 1/4, for any pair); the DEQ's stay below 1 and spread out, x and -x far apart."""
    X = unit(10, 4, seed=6)
    X[1] = -X[0]  # an opposite pair, the hardest to forget
    depths = [1, 10, 100, 2000]
    out = finite_depth_kernels(X, X, depths, 0.5, 0.3, 0.2, injection=False)
    off = ~torch.eye(10, dtype=torch.bool)
    gp_least, tk_spread = [], []
    for L in depths:
        gp, tk = out[L]
        gp_least.append(normalised(gp, gp.diagonal(), gp.diagonal())[off].min().item())
        tk_off = normalised(tk, tk.diagonal(), tk.diagonal())[off]
        tk_spread.append((tk_off.max() - tk_off.min()).item())
    assert all(b > a for a, b in zip(gp_least, gp_least[1:], strict=False)) and gp_least[-1] > 0.9999
    assert all(b < a for a, b in zip(tk_spread, tk_spread[1:], strict=False)) and tk_spread[-1] < 0.003
    gp, tk = deq_nngp(X, X, 0.5, 0.3, 0.2), deq_ntk(X, X, 0.5, 0.3, 0.2)
    assert normalised(gp, gp.diagonal(), gp.diagonal())[off].max() < 0.96
    deq_off = normalised(tk, tk.diagonal(), tk.diagonal())[off]
    assert deq_off.max() < 0.9 and deq_off.max() - deq_off.min() > 0.5
    assert normalised(tk, tk.diagonal(), tk.diagonal())[0, 1] < 0.2  # the DEQ still tells x from -x


@pytest.mark.parametrize("X,match", [
    (torch.tensor([[3.0, 4.0]]), "unit L2 norm"),
    (torch.tensor([[1.0, 0.0], [0.0, 1.0 + 1e-4]]), "row 1 has norm"),
    (torch.ones(2, 2, 2), r"\[n, d\] matrix"),
])
def test_non_unit_inputs_are_refused(X, match):
    with pytest.raises(ConfigError, match=match):
        deq_ntk(X, torch.eye(2), 0.5, 0.3, 0.2)
    with pytest.raises(ConfigError, match=match):
        deq_nngp(torch.eye(2), X, 0.5, 0.3, 0.2)


@pytest.mark.parametrize("variances,match", [
    ((0.5, 0.3, 0.3), r"sw2 \+ su2 \+ sb2 = 1"),
    ((1.0, 0.0, 0.0), "sw2 must be < 1"),
    ((1.2, -0.1, -0.1), "must be a finite number >= 0"),
    ((0.5, float("nan"), 0.5), "must be a finite number >= 0"),
])
def test_bad_variances_are_refused(variances, match):
    with pytest.raises(ConfigError, match=match):
        deq_ntk(torch.eye(2), torch.eye(2), *variances)
    with pytest.raises(ConfigError, match=match):
        finite_depth_kernels(torch.eye(2), torch.eye(2), [3], *variances)


def test_bad_phantom_steps_and_dimensions_are_refused():
    with pytest.raises(ConfigError, match="phantom_steps must be >= 1"):
        deq_ntk(torch.eye(2), torch.eye(2), 0.5, 0.3, 0.2, phantom_steps=0)
    with pytest.raises(ConfigError, match="same dimension"):
        deq_ntk(torch.eye(2), torch.eye(3), 0.5, 0.3, 0.2)
