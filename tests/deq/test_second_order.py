"""Second derivatives through the DEQ layer, per backward mode, in float64 on a tiny map.

* ``unroll``: with the tolerance out of reach every call runs exactly ``max_iter`` Picard iterations, a fixed
  composition of smooth maps, so finite differences (gradcheck / gradgradcheck) are valid references.
* ``phantom``: finite differences would move the fixed point; the reference is the K damped steps written out by
  hand from the frozen fixed point, differentiated with plain autograd.
* ``ift``: first derivatives equal finite differences of the converged map; a second derivative raises.
"""

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call

from deqscore.deq import DEQ
from deqscore.deq.layer import SecondOrderIFTError

D = 3


class Map(nn.Module):
    """``f(z, u) = tanh(0.5 * Linear(z) + u)``: a contraction (the Linear has spectral norm 0.9)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)
        with torch.no_grad():
            self.lin.weight.mul_(0.9 / torch.linalg.matrix_norm(self.lin.weight, ord=2))

    def forward(self, z, u):
        return torch.tanh(0.5 * self.lin(z) + u)


def _layer(backward: str, **kw) -> DEQ:
    torch.manual_seed(0)
    return DEQ(Map(), backward=backward, warn_on_nonconvergence=False, **kw)


def _inputs(n: int = 2) -> torch.Tensor:
    return torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _as_function(deq: DEQ, transform=None):
    """``(x, weight, bias) -> transform(deq(x))`` with the map's parameters as explicit inputs."""
    names = ["func.lin.weight", "func.lin.bias"]

    def f(x, weight, bias):
        z = functional_call(deq, dict(zip(names, (weight, bias), strict=True)), (x,))
        return z if transform is None else transform(x, z)

    params = [p.detach().clone().requires_grad_() for p in (deq.func.lin.weight, deq.func.lin.bias)]
    return f, params


def _energy_input_gradient(x, z):
    """The input gradient of the energy ``E(x) = sum(z(x)^2 + z(x) x)`` (create_graph: a score-like quantity)."""
    energy = (z.pow(2) + z * x).sum()
    (gx,) = torch.autograd.grad(energy, x, create_graph=True)
    return gx


# ----- unroll: a fixed composition, checked against finite differences --------------------------------------------


def test_unroll_runs_exactly_max_iter_iterations_when_the_tolerance_is_out_of_reach():
    deq = _layer("unroll", max_iter=12, tol=1e-300)
    deq(_inputs())
    assert deq.stats.nstep == 12 and not deq.stats.converged


@pytest.mark.parametrize("transform", [None, _energy_input_gradient], ids=["output", "energy_input_gradient"])
def test_unroll_gradcheck_and_gradgradcheck(transform):
    deq = _layer("unroll", max_iter=12, tol=1e-300)
    f, params = _as_function(deq, transform)
    x = _inputs().requires_grad_()
    assert gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-6)
    assert gradgradcheck(f, (x, *params), eps=1e-6, atol=1e-6, rtol=1e-5)


# ----- phantom: the hand-written K damped steps from the frozen fixed point --------------------------------------

K, LAM = 3, 0.6


def _hand_phantom(deq: DEQ, u: torch.Tensor) -> torch.Tensor:
    """K damped steps from the converged fixed point, detached, written out with plain autograd."""
    with torch.no_grad():
        z = torch.zeros_like(u)
        for _ in range(500):
            z = deq.func(z, u)
    for _ in range(K):
        z = LAM * deq.func(z, u) + (1 - LAM) * z
    return z


def _phantom_layer() -> DEQ:
    return _layer("phantom", solver="anderson", tol=1e-13, max_iter=200, phantom_steps=K, phantom_damping=LAM)


def _sm_loss(net, x):
    """``sum 0.5 |s|^2 + tr(ds/dx)`` of the score-like ``s = grad_x E``, ``E = sum(z(x)^2 + z(x) x)``."""
    z = net(x)
    s = _energy_input_gradient(x, z)
    trace = sum(torch.autograd.grad(s[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(D))
    return (0.5 * s.pow(2).sum(1) + trace).sum()


def test_phantom_first_and_second_derivatives_equal_the_hand_written_steps():
    deq = _phantom_layer()
    params = list(deq.parameters())
    x = _inputs(4).requires_grad_()

    # the value and the input gradient
    z_deq, z_ref = deq(x), _hand_phantom(deq, x)
    torch.testing.assert_close(z_deq, z_ref, rtol=0, atol=1e-12)
    v = torch.randn_like(x)
    (g_deq,) = torch.autograd.grad(z_deq, x, v, create_graph=True)
    (g_ref,) = torch.autograd.grad(z_ref, x, v, create_graph=True)
    torch.testing.assert_close(g_deq, g_ref, rtol=1e-10, atol=1e-12)
    # a Hessian-vector product in the input, and the parameter gradient of the input gradient
    w = torch.randn_like(x)
    hv_deq = torch.autograd.grad((g_deq * w).sum(), [x, *params])
    hv_ref = torch.autograd.grad((g_ref * w).sum(), [x, *params])
    for a, b in zip(hv_deq, hv_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    # the parameter gradient of a score-matching loss (three derivatives deep)
    grads_deq = torch.autograd.grad(_sm_loss(deq, x), params)
    grads_ref = torch.autograd.grad(_sm_loss(lambda y: _hand_phantom(deq, y), x), params)
    for a, b in zip(grads_deq, grads_ref, strict=True):
        assert a.abs().max() > 1e-3
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ----- ift: first order only ------------------------------------------------------------------------------------


def _converged_ift_layer() -> DEQ:
    return _layer("ift", solver="anderson", tol=1e-13, max_iter=300, ift_tol=1e-14, ift_max_iter=500)


def test_ift_gradient_equals_finite_differences_of_the_converged_map():
    deq = _converged_ift_layer()
    f, params = _as_function(deq)
    x = _inputs().requires_grad_()
    # the converged map is smooth and the solve is accurate to ~1e-13: FD of it are its exact derivatives
    assert gradcheck(f, (x, *params), eps=1e-6, atol=1e-6, rtol=1e-5, check_undefined_grad=False)


def test_ift_refuses_a_second_derivative():
    deq = _converged_ift_layer()
    x = _inputs().requires_grad_()
    energy = deq(x).pow(2).sum()
    with pytest.raises(SecondOrderIFTError, match="phantom"):
        torch.autograd.grad(energy, x, create_graph=True)
    # first order (no graph of the derivative) is allowed
    (gx,) = torch.autograd.grad(deq(x).pow(2).sum(), x)
    assert torch.isfinite(gx).all()
