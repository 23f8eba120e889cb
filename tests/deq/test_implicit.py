"""``backward="implicit"`` on a tiny float64 tanh map: derivatives of the first three orders against the unrolled
solve and finite differences, what it keeps in memory (independent of the solver's iterations), and that the nested
(adjoint) solves behave like the forward one: statistics, warnings, check_every, warm starts, autocast. Also the
direct solve of a map linear in z."""

import warnings

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call

from deqscore.deq import DEQ, DEQConvergenceWarning, deq_backward, exact_gradients, require_backward
from deqscore.metrics import SavedTensorMeter
from deqscore.metrics.memory import measures_func_transforms

from .helpers import LinearMap, TanhMap

# the meter reads an implicit step's graph through torch 2.14's node-creation hook (deqscore.metrics.memory)
needs_node_hooks = pytest.mark.skipif(not measures_func_transforms(), reason="torch before 2.14 cannot measure "
                                      "a step that runs torch.func")

D = 4


def _layer(backward="implicit", seed=0, map_cls=TanhMap, **kw) -> DEQ:
    torch.manual_seed(seed)
    options = {"solver": "anderson", "tol": 1e-12, "max_iter": 500, **kw}
    if backward == "unroll":
        options.update(solver="picard", tol=1e-13, max_iter=3000)
    return DEQ(map_cls(D, 0.6), backward=backward, **options)


def _x(n=3) -> torch.Tensor:
    return torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()


def _ssm_gradient(deq: DEQ, x: torch.Tensor) -> list[torch.Tensor]:
    """The parameter gradient of an SSM-like loss of the energy ``E = sum(z^2 + z x)``: ``0.5 |s|^2 + v^T ds/dx v``
    with ``s = dE/dx``; three derivatives through the fixed point."""
    z = deq(x)
    (s,) = torch.autograd.grad((z.pow(2) + z * x).sum(), x, create_graph=True)
    v = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(5))
    (hv,) = torch.autograd.grad((s * v).sum(), x, create_graph=True)
    loss = 0.5 * s.pow(2).sum() + (hv * v).sum()
    return list(torch.autograd.grad(loss, list(deq.parameters())))


def _rel(a, b) -> float:
    return float(sum((p - q).pow(2).sum() for p, q in zip(a, b, strict=True)) ** 0.5
                 / sum(q.pow(2).sum() for q in b) ** 0.5)


def test_third_order_gradient_equals_the_unrolled_solve_and_phantom_steps_do_not():
    x = _x()
    exact = _ssm_gradient(_layer("unroll"), x)
    assert _rel(_ssm_gradient(_layer(), x), exact) < 1e-9
    # the control: two phantom steps give another gradient on the same problem
    assert _rel(_ssm_gradient(_layer("phantom", phantom_steps=2), x), exact) > 1e-2


def test_first_and_second_derivatives_equal_finite_differences_of_the_converged_solve():
    deq = _layer()

    def f(x, weight):
        z = functional_call(deq, {"func.weight": weight}, (x,))
        (s,) = torch.autograd.grad((z.pow(2) + z * x).sum(), x, create_graph=True)  # a score-like derivative
        return s

    weight = deq.func.weight.detach().clone().requires_grad_()
    assert gradcheck(f, (_x(2), weight), eps=1e-6, atol=1e-6, rtol=1e-5)
    assert gradgradcheck(f, (_x(2), weight), eps=1e-6, atol=1e-6, rtol=1e-5)


def _graph_bytes(deq: DEQ) -> int:
    """What the step's graph saves (parameters excluded): the loss with its two input derivatives, and its backward."""
    x = _x()
    with warnings.catch_warnings(), SavedTensorMeter(exclude=deq.parameters()) as meter:
        warnings.simplefilter("ignore", DEQConvergenceWarning)
        _ssm_gradient(deq, x)
    return meter.bytes


@needs_node_hooks
def test_memory_does_not_grow_with_the_solver_iterations():
    # tol out of reach: every solve runs exactly max_iter iterations
    short, long = (_graph_bytes(_layer(max_iter=n, tol=1e-300)) for n in (5, 40))
    assert short == long > 0
    unrolled = [_graph_bytes(DEQ(TanhMap(D, 0.6), backward="unroll", max_iter=n, tol=1e-300)) for n in (5, 40)]
    assert unrolled[1] > 4 * unrolled[0]  # the control: the unrolled graph grows with them


def test_adjoint_solves_are_logged_per_level_and_warn_like_the_forward():
    deq = _layer()
    _ssm_gradient(deq, _x())
    assert sorted(deq.adjoint_stats) == [1, 2, 3]  # one level per derivative order
    for stats in deq.adjoint_stats.values():
        assert stats.converged and stats.stop_mode == "rel" and stats.rel_residual < 1e-12 and stats.nstep > 2
    z_star = _layer()(_x()).detach()
    tight = _layer(max_iter=3)
    with pytest.warns(DEQConvergenceWarning, match=r"adjoint solve \(level 1\)"):
        torch.autograd.grad(tight(_x(), z0=z_star).sum(), list(tight.parameters()))
    assert not tight.adjoint_stats[1].converged and tight.adjoint_stats[1].nstep == 3
    assert tight.ift_failure_fraction().item() == 1.0  # counted with the backward solves


def test_check_every_zero_defers_the_adjoint_solves_counts_without_warning():
    deq = _layer(max_iter=3, check_every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DEQConvergenceWarning)  # nothing warns before the counts are read
        torch.autograd.grad(deq(_x()).sum(), list(deq.parameters()))
    assert deq.adjoint_stats[1].deferred and deq.adjoint_stats[1].nstep == 3
    with pytest.warns(DEQConvergenceWarning, match="1 IFT backward solves did not meet"):
        counts = deq.read_deferred()
    assert counts["backward_failures"] == 1.0


def test_warm_start_restarts_the_adjoint_from_the_last_one_of_its_level():
    deq = _layer(warm_start=True)
    x = _x()
    grads = [torch.autograd.grad(deq(x).pow(2).sum(), list(deq.parameters())) for _ in range(2)]
    cold, warm = (_layer(), deq)
    torch.autograd.grad(cold(x).pow(2).sum(), list(cold.parameters()))
    assert warm.adjoint_stats[1].nstep < cold.adjoint_stats[1].nstep
    assert _rel(grads[1], grads[0]) < 1e-10  # the derivative does not depend on where the solve starts


def test_autocast_solves_and_differentiates_in_float32():
    torch.manual_seed(0)
    deq = DEQ(TanhMap(D, 0.6).float(), backward="implicit", tol=1e-5)
    x = _x().detach().float().requires_grad_()
    want = torch.autograd.grad(deq(x).pow(2).sum(), [x, deq.func.weight])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = deq(x)
        got = torch.autograd.grad(z.pow(2).sum(), [x, deq.func.weight])
    assert z.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got)
    assert _rel(got, want) < 1e-5


def test_a_map_linear_in_z_is_solved_directly_to_every_order():
    class Affine(LinearMap):
        def affine_weight(self):
            return self.weight

    direct, iterative = _layer(map_cls=Affine), _layer(map_cls=LinearMap)
    assert direct.direct and not iterative.direct
    x = _x()
    z = direct(x)
    torch.testing.assert_close(z, iterative(x), rtol=0, atol=1e-11)
    # closed form: z = x (I - A^T)^{-1}
    a = direct.func.weight.detach()
    torch.testing.assert_close(z, torch.linalg.solve(torch.eye(D, dtype=a.dtype) - a, x.T).T, rtol=0, atol=1e-12)
    assert direct.stats.solver == "direct" and direct.stats.converged and direct.stats.nstep == 1
    assert _rel(_ssm_gradient(direct, x), _ssm_gradient(_layer("unroll", map_cls=LinearMap), x)) < 1e-9


def test_require_backward_accepts_implicit_at_any_order_and_deq_backward_switches_to_it():
    net = nn.Sequential(_layer("phantom", phantom_steps=1))
    require_backward(_layer(), order=3, user="a third-order loss")
    x = _x()
    exact = _ssm_gradient(_layer("unroll"), x)
    with deq_backward(net, "implicit"):
        assert _rel(_ssm_gradient(net[0], x), exact) < 1e-9
    assert net[0].backward == "phantom"


def test_exact_gradients_is_the_unrolled_gradient_of_a_phantom_model_and_leaves_its_mode():
    deq, x = _layer("phantom", phantom_steps=2), _x()
    params = list(deq.parameters())

    def objective():
        z = deq(x)
        (s,) = torch.autograd.grad((z.pow(2) + z * x).sum(), x, create_graph=True)
        return s.pow(2).sum()

    value, grads = exact_gradients(deq, objective, params)
    with deq_backward(deq, "unroll"):
        deq.solver, deq.tol, deq.max_iter = "picard", 1e-13, 3000
        want = torch.autograd.grad(objective(), params)
    assert deq.backward == "phantom" and _rel(grads, want) < 1e-9
    assert _rel(torch.autograd.grad(objective(), params), want) > 1e-2  # the phantom gradient is another one


class _AddedInputTanhMap(TanhMap):
    """``f(z, u) = tanh(W z) + u``: ``u`` enters as an added term."""

    additive_injection = True

    def forward(self, z, u):
        return torch.tanh(z @ self.weight.T) + u


@needs_node_hooks
def test_an_input_gradient_records_only_the_fixed_point_and_its_adjoint():
    """The score's input gradient (create_graph) needs no partial in the map's parameters, and the partial in an
    added input is the adjoint solution itself: the graph holds z* and w, no evaluation of the map."""
    torch.manual_seed(0)
    deq = DEQ(_AddedInputTanhMap(D, 0.6), backward="implicit", solver="anderson", tol=1e-12, max_iter=500)
    x = _x()
    with SavedTensorMeter(exclude=deq.parameters()) as meter:
        (s,) = torch.autograd.grad(deq(x).pow(2).sum() / 2, x, create_graph=True)
    # z* (which pow saves too) and w, each of its own size (plus the zero placeholders' 8 bytes each): no room for
    # a third [B, D] tensor, which any evaluation of the map would save
    assert 2 * x.numel() * x.element_size() <= meter.bytes < 3 * x.numel() * x.element_size()
    unrolled = DEQ(_AddedInputTanhMap(D, 0.6), backward="unroll", solver="picard", tol=1e-13, max_iter=3000)
    unrolled.load_state_dict(deq.state_dict())
    (exact,) = torch.autograd.grad(unrolled(x).pow(2).sum() / 2, x)
    assert _rel([s], [exact]) < 1e-9


def test_a_direct_solve_at_its_rounding_floor_is_converged_and_a_wrong_one_is_not():
    """Large z in float32: the residual of an exact solve is rounding above an absolute tolerance; the solve is still
    converged (no warning). The floor is relative to f(z): an error of 1e-3 is not taken for rounding."""
    from deqscore.deq.solvers import residual_stats

    z = torch.full((2, 64), 3e4)
    fz = z + torch.finfo(torch.float32).eps * 3e4 * torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    stats = residual_stats("direct", z, fz, tol=5e-5)
    assert stats.abs_residual > 5e-5 and stats.converged
    assert not residual_stats("direct", z, z * (1 + 1e-3), tol=5e-5).converged
    deferred = residual_stats("direct", z, fz, tol=5e-5, check_every=0)
    assert bool(deferred.converged)
