"""Every family's score network through its DEQ with ``backward="implicit"``, under its own loss (its declaration's
``phantom_probe``), float64: the parameter gradient of the loss equals that of the same network with the layer
unrolled to convergence (the exact derivative of the converged solve), and finite differences of the loss and of
its gradient agree with its first and second derivatives (gradcheck, gradgradcheck). For the energy families (NICE's
SSM, DKEF's SSM-VR) the loss already takes two derivatives through the layer, so its parameter gradient is the
third derivative of the fixed point and gradgradcheck checks the fourth; for the score networks (VAE, NCSN: SSM-VR
of a score) one order less. DKEF's map is linear in z and is solved directly; its iterative solve is checked too.

A nest whose adjoint solves are cut from the graph (their inputs detached) must fail the same comparison."""

import functools

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call

from deqscore.deq import DEQ
from deqscore.deq.implicit import FixedPoint
from deqscore.models.dkef_features import DKEFDEQMap
from tests.deq.helpers import loss_gradients
from tests.deq.test_family_phantom import FAMILIES

IMPLICIT = functools.partial(DEQ, backward="implicit", solver="anderson", tol=1e-12, max_iter=500)
UNROLLED = functools.partial(DEQ, backward="unroll", tol=1e-11, max_iter=3000)

CASES = [*FAMILIES, "dkef_iterative"]
pytestmark = pytest.mark.filterwarnings("ignore:Attribute .net. is an instance")


@pytest.fixture
def probe(request, monkeypatch):
    """The family's probe; ``dkef_iterative``: DKEF's, its map no longer declaring itself linear."""
    if request.param == "dkef_iterative":
        monkeypatch.delattr(DKEFDEQMap, "affine_weight")
        return FAMILIES["dkef"]
    return FAMILIES[request.param]


def _relative_error(got: dict, want: dict) -> float:
    num = sum(float((got[n] - want[n]).pow(2).sum()) for n in want if want[n] is not None)
    den = sum(float(want[n].pow(2).sum()) for n in want if want[n] is not None)
    return (num / den) ** 0.5


def implicit_vs_unrolled(build) -> float:
    """The relative error of the loss's parameter gradient through the implicit layer against the unrolled one."""
    module, got = loss_gradients(build, IMPLICIT)
    deqs = [m for m in module.modules() if isinstance(m, DEQ)]
    assert deqs and all(m.backward == "implicit" and m.stats.converged for m in deqs)
    _, want = loss_gradients(build, UNROLLED, module.state_dict())
    inside = [n for n in want if ".func." in n and want[n] is not None]
    assert inside and all(got[n] is not None for n in inside)
    return _relative_error(got, want)


@pytest.mark.parametrize("probe", CASES, indirect=True)
def test_implicit_loss_gradient_equals_the_unrolled_solve(probe):
    # the solves meet 1e-12 and 1e-11: agreement to ~1e-10 (what method.md promises: the solves' tolerance)
    assert implicit_vs_unrolled(probe) < 1e-8


@pytest.mark.parametrize("level", [1, 2])
def test_cutting_the_nest_at_an_adjoint_level_fails_the_comparison(monkeypatch, level):
    """The adjoint solves from ``level`` on see detached inputs: the derivatives of that order and above lose the
    terms through the adjoint, and the third-order SSM gradient of NICE moves far from the unrolled one."""
    apply = FixedPoint.apply

    def cut(lv, start, *tensors):
        if lv.index >= level:
            tensors = tuple(t.detach() for t in tensors)
        return apply(lv, start, *tensors)

    monkeypatch.setattr(FixedPoint, "apply", cut)
    assert implicit_vs_unrolled(FAMILIES["nice"]) > 1e-3


class _Loss(torch.nn.Module):
    """The probe's loss as a module's forward, so that functional_call can swap a parameter of ``net`` for it."""

    def __init__(self, net, loss):
        super().__init__()
        self.net, self.loss = net, loss

    def forward(self):
        torch.manual_seed(3)  # the same draws at every call
        return self.loss().mean()


#: the parameter moved by the finite differences: NICE's map differentiates its normaliser, the other maps hold it
#: constant by design (a detached norm, which finite differences would see), so there it is the parameter of the
#: layer's input u (upstream of the map): its derivatives reach the loss through the same nest of solves.
MOVED = {"nice": ".func.lin1.weight", "dkef": ".inject.weight", "dkef_iterative": ".inject.weight",
         "vae": ".inject.weight", "ncsn": ".down.conv1.weight"}


def _loss_along_a_direction(build, fragment):
    """``q -> loss(theta + q v)`` for the parameter ``theta`` named by ``fragment`` and a fixed random direction
    ``v``: finite differences in one variable check the directional derivatives at a small cost."""
    torch.manual_seed(0)
    wrapper = _Loss(*build(IMPLICIT))
    name = next(n for n, _ in wrapper.named_parameters() if fragment in n)
    theta = dict(wrapper.named_parameters())[name].detach()
    v = torch.randn(theta.shape, dtype=theta.dtype, generator=torch.Generator().manual_seed(4))
    return lambda q: functional_call(wrapper, {name: theta + q * v * theta.abs().mean()}, ())


@pytest.mark.parametrize("probe", [
    "dkef", "vae",
    # ~25 s each on a shared 2-core CPU: NICE's gradgradcheck is the fourth derivative (16 solves per evaluation)
    *(pytest.param(c, marks=pytest.mark.slow) for c in ("nice", "ncsn")),
    pytest.param("dkef_iterative", marks=pytest.mark.slow),  # one adjoint solve per batched gradient: ~1 min
], indirect=True)
def test_implicit_loss_passes_gradcheck_and_gradgradcheck(probe, request):
    case = request.node.callspec.params["probe"]
    f = _loss_along_a_direction(probe, MOVED[case])
    q = torch.zeros((), dtype=torch.float64, requires_grad=True)
    # the converged solve is a smooth function of q, accurate to ~1e-12: finite differences with eps 1e-6 are
    # accurate to ~1e-6 relative
    assert gradcheck(f, (q,), eps=1e-6, atol=1e-6, rtol=1e-5)
    if case != "ncsn":  # NCSN's instance norms have no third derivative in PyTorch (batch_norm's limit)
        assert gradgradcheck(f, (q,), eps=1e-6, atol=1e-6, rtol=1e-5)
