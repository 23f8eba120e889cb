import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

from deqscore.deq import DEQ, DEQConvergenceWarning, SecondOrderIFTError, require_backward
from deqscore.errors import ConfigError
from deqscore.losses import score_from_log_prob, sliced_score_matching

from .helpers import LinearMap, TanhMap

DIM = 8


class EnergyNet(nn.Module):
    """x -> u = W_in x -> z* = f(z*, u) -> log p = -0.5 ||z*||^2 + c^T z*: a DEQ inside a log-density."""

    def __init__(self, deq: DEQ):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, dtype=torch.float64)
        self.deq = deq
        self.out = nn.Linear(DIM, 1, dtype=torch.float64)

    def forward(self, x):
        z = self.deq(self.inp(x))
        return self.out(z).squeeze(-1) - 0.5 * (z**2).sum(-1)


def _make(backward, rho=0.5, **kw):
    torch.manual_seed(1)
    func = TanhMap(DIM, rho=rho)
    kw.setdefault("tol", 1e-12)
    kw.setdefault("max_iter", 500)
    return EnergyNet(DEQ(func, solver="anderson", backward=backward, **kw))


def _flat_grads(loss, params):
    """Parameter gradients as one vector (zeros for parameters the loss does not use, e.g. output biases)."""
    grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return torch.cat([g.flatten() for g in grads])


def _ssm_param_grads(net, x):
    torch.manual_seed(7)  # same projections for every model compared
    loss = sliced_score_matching(score_from_log_prob(net), x, n_projections=4).mean()
    return _flat_grads(loss, list(net.parameters()))


def test_fixed_point_matches_long_plain_iteration():
    deq = DEQ(TanhMap(DIM, 0.7), solver="broyden", tol=1e-12, max_iter=200)
    u = torch.randn(5, DIM, dtype=torch.float64)
    z = deq(u)
    ref = torch.zeros_like(u)
    for _ in range(300):
        ref = deq.func(ref, u)
    assert deq.stats.converged
    assert torch.allclose(z, ref, atol=1e-10)


def test_unroll_equals_hand_written_reference():
    net = _make("unroll", max_iter=30, tol=1e-30, warn_on_nonconvergence=False)
    x = torch.randn(4, DIM, dtype=torch.float64)
    got = _ssm_param_grads(net, x)

    def reference_logp(x):  # the same 30 Picard steps, written out
        u = net.inp(x)
        z = torch.zeros_like(u)
        for _ in range(30):
            z = net.deq.func(z, u)
        return net.out(z).squeeze(-1) - 0.5 * (z**2).sum(-1)

    torch.manual_seed(7)
    loss = sliced_score_matching(score_from_log_prob(reference_logp), x, n_projections=4).mean()
    ref = _flat_grads(loss, list(net.parameters()))
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-14)


def test_phantom_gradients_converge_to_exact_like_contraction_power():
    rho = 0.5
    x = torch.randn(16, DIM, dtype=torch.float64)
    exact = _ssm_param_grads(_make("unroll", rho=rho, max_iter=200, tol=1e-14), x)
    errors = []
    for k in (1, 2, 4, 8, 16):
        g = _ssm_param_grads(_make("phantom", rho=rho, phantom_steps=k), x)
        errors.append(((g - exact).norm() / exact.norm()).item())
    # doubling K shrinks the error at least like the contraction factor rho^K (the Neumann tail)
    for k, (e_k, e_2k) in zip((1, 2, 4, 8), zip(errors, errors[1:], strict=False), strict=True):
        assert e_2k <= 2 * rho**k * e_k, (k, errors)
    assert errors[0] > 0.1 and errors[-1] < 1e-6, errors  # K=1 visibly wrong, K=16 essentially exact


def test_phantom_jacobian_is_damped_neumann_sum():
    """Prop. 2: K damped steps give dz_K/du = lam * sum_{k<K} (lam A + (1-lam) I)^k for f = A z + u."""
    func = LinearMap(DIM, rho=0.6)
    lam, K = 0.5, 3
    deq = DEQ(func, solver="picard", tol=1e-13, max_iter=400, phantom_steps=K, phantom_damping=lam)
    u = torch.randn(1, DIM, dtype=torch.float64, requires_grad=True)
    jac = torch.autograd.functional.jacobian(lambda u: deq(u)[0], u)[:, 0]
    a = func.weight.detach()
    m = lam * a + (1 - lam) * torch.eye(DIM, dtype=torch.float64)
    expected = lam * sum(torch.linalg.matrix_power(m, k) for k in range(K))
    assert torch.allclose(jac, expected, atol=1e-10)
    # and the value is the true fixed point (I - A)^-1 u
    z = deq(u.detach())
    assert torch.allclose(z[0], torch.linalg.solve(torch.eye(DIM, dtype=torch.float64) - a, u.detach()[0]))


def test_injection_prestep_adds_one_neumann_term():
    func = LinearMap(DIM, rho=0.6)
    deq = DEQ(func, solver="picard", tol=1e-13, max_iter=400, phantom_steps=1, injection_prestep=True)
    u = torch.randn(1, DIM, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda u: deq(u)[0], u)[:, 0]
    a = func.weight.detach()
    assert torch.allclose(jac, torch.eye(DIM, dtype=torch.float64) + a, atol=1e-10)


def test_ift_is_exact_for_first_order_loss():
    x = torch.randn(6, DIM, dtype=torch.float64)

    def grads(net):
        loss = net(x).pow(2).mean()
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(net.parameters()))])

    exact = grads(_make("unroll", rho=0.8, max_iter=400, tol=1e-14))
    ift = grads(_make("ift", rho=0.8))
    phantom1 = grads(_make("phantom", rho=0.8, phantom_steps=1))
    assert torch.allclose(ift, exact, rtol=1e-7, atol=1e-10)
    assert not torch.allclose(phantom1, exact, rtol=1e-3)  # the comparison can tell them apart


def test_ift_refuses_second_order_losses():
    net = _make("ift")
    x = torch.randn(4, DIM, dtype=torch.float64)
    with pytest.raises(SecondOrderIFTError, match="phantom"):
        sliced_score_matching(score_from_log_prob(net), x).mean().backward()


def test_warm_start_reuses_fixed_point_and_stays_out_of_checkpoints():
    deq = DEQ(TanhMap(DIM, 0.9), solver="picard", tol=1e-10, max_iter=500, warm_start=True)
    u = torch.randn(3, DIM, dtype=torch.float64)
    z1 = deq(u)
    cold = deq.stats.nstep
    z2 = deq(u)
    assert deq.stats.nstep < cold / 4
    assert torch.allclose(z1, z2, atol=1e-9)
    assert "z_cache" not in deq.state_dict()
    assert not list(deq.buffers())  # filling the cache does not change the module's buffers
    deq(torch.randn(5, DIM, dtype=torch.float64))  # new shape: cold start, no shape error
    assert deq.stats.nstep > cold / 2


def test_eval_mode_computes_the_same_differentiable_function():
    net = _make("phantom", phantom_steps=2)
    x = torch.randn(4, DIM, dtype=torch.float64, requires_grad=True)
    s_train = torch.autograd.grad(net(x).sum(), x)[0]
    net.eval()
    s_eval = torch.autograd.grad(net(x).sum(), x)[0]
    assert torch.allclose(s_train, s_eval, atol=1e-10)


def test_nonconvergence_warns_with_numbers():
    deq = DEQ(TanhMap(DIM, 0.99), solver="picard", tol=1e-14, max_iter=3)
    with pytest.warns(DEQConvergenceWarning, match=r"did not converge in 3 iterations: abs residual \d"):
        deq(torch.randn(2, DIM, dtype=torch.float64))
    assert deq.stats.converged is False


def test_bad_settings_raise():
    f = TanhMap(DIM)
    with pytest.raises(ValueError, match="unknown DEQ solver"):
        DEQ(f, solver="newton")
    with pytest.raises(ValueError, match="backward"):
        DEQ(f, backward="adjoint")
    with pytest.raises(ValueError, match="phantom_steps"):
        DEQ(f, phantom_steps=0)
    with pytest.raises(ValueError, match="damping"):
        DEQ(f, phantom_damping=1.5)


NAN, INF = float("nan"), float("inf")
BAD_OPTIONS = [  # (option, value, what the message must say)
    *[(key, v, f"DEQ {key} must be finite, got {v}") for key in ("tol", "phantom_damping", "ift_tol")
      for v in (NAN, INF, -INF)],
    ("tol", 0.0, "DEQ tol must be positive, got 0.0"),
    ("tol", -1.0, "DEQ tol must be positive, got -1.0"),
    ("tol", "1e-5", "DEQ tol must be a number, got '1e-5'"),
    ("tol", True, "DEQ tol must be a number, got True"),
    ("ift_tol", 0.0, "DEQ ift_tol must be positive, got 0.0"),
    ("ift_tol", -1e-8, "DEQ ift_tol must be positive"),
    ("phantom_damping", 0.0, "DEQ phantom_damping must be positive"),
    ("phantom_damping", 1.5, r"DEQ phantom_damping must lie in \(0, 1\], got 1.5"),
    *[(key, v, f"DEQ {key} must be >= 1, got {v}") for key in ("max_iter", "phantom_steps", "ift_max_iter")
      for v in (0, -3)],
    *[(key, v, f"DEQ {key} must be an int >= 1, got {v!r}") for key in ("max_iter", "phantom_steps", "ift_max_iter")
      for v in (True, 2.0, NAN, "3")],
    ("phantom_steps", 0, "with 0 steps the output carries no gradient"),
]


@pytest.mark.parametrize(("option", "value", "message"), BAD_OPTIONS)
def test_bad_option_raises_config_error_naming_it(option, value, message):
    with pytest.raises(ConfigError, match=message):
        DEQ(TanhMap(DIM), **{option: value})


def test_edge_values_are_accepted():
    deq = DEQ(TanhMap(DIM), tol=1e-30, max_iter=1, phantom_steps=1, phantom_damping=1.0, ift_max_iter=1,
              ift_tol=1e300)
    assert deq.max_iter == 1 and deq.phantom_damping == 1.0


def test_no_warning_when_converged():
    deq = DEQ(TanhMap(DIM, 0.5), tol=1e-8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deq(torch.randn(2, DIM, dtype=torch.float64))


def test_deq_backward_switches_modes_temporarily():
    from deqscore.deq import deq_backward

    net = _make("ift", rho=0.8)
    x = torch.randn(4, DIM, dtype=torch.float64)
    exact = _ssm_param_grads(_make("unroll", rho=0.8, max_iter=400, tol=1e-14), x)
    with deq_backward(net, "unroll"):
        got = _ssm_param_grads(net, x)
    assert torch.allclose(got, exact, rtol=1e-6, atol=1e-10)
    assert net.deq.backward == "ift"
    with pytest.raises(ValueError, match="unknown DEQ backward"), deq_backward(net, "adjoint"):
        pass


def test_unroll_ignores_warm_start_so_its_derivative_stays_exact():
    net = _make("unroll", rho=0.8, max_iter=400, tol=1e-12, warm_start=True)
    x = torch.randn(4, DIM, dtype=torch.float64)
    first = _ssm_param_grads(net, x)
    cold_steps = net.deq.stats.nstep
    second = _ssm_param_grads(net, x)  # same shape: a warm start would stop after one recorded step
    assert net.deq.stats.nstep == cold_steps
    assert torch.allclose(first, second, rtol=1e-12)


def test_ift_backward_warns_when_its_solve_does_not_converge():
    net = _make("ift", rho=0.9, ift_max_iter=2)
    x = torch.randn(4, DIM, dtype=torch.float64)
    with pytest.warns(DEQConvergenceWarning, match="IFT backward solve of solver 'picard' did not converge in 2 "):
        net(x).pow(2).mean().backward()


class ExpandingMap(nn.Module):
    """``f(z, u) = A z + u`` with ``A``'s eigenvalues -1.5, 1.3, 0.5 and -0.2 (spectral radius 1.5, ``I - A``
    invertible), iterated as any map (no ``affine_weight``): the Neumann series of ``(I - A^T)^-1`` diverges."""

    def __init__(self):
        super().__init__()
        q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("a", q @ torch.diag(torch.tensor([-1.5, 1.3, 0.5, -0.2], dtype=torch.float64)) @ q.T)

    def forward(self, z, u):
        return z @ self.a.T + u


@pytest.mark.parametrize("ift_solver", ["anderson", "broyden"])
def test_ift_backward_with_a_quasi_newton_solver_is_exact_past_a_spectral_radius_of_one(ift_solver):
    """dL/du = (I - A^T)^-1 c for L = c . z*, z* = (I - A)^-1 u: the registry's solvers meet it where the
    default Neumann series (picard) does not."""
    u = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, 4, dtype=torch.float64)
    for solver in ("picard", ift_solver):
        deq = DEQ(ExpandingMap(), solver="anderson", tol=1e-12, max_iter=50, backward="ift", ift_solver=solver,
                  ift_tol=1e-12, ift_max_iter=50)
        u.grad = None
        z = deq(u)
        assert torch.allclose(z, torch.linalg.solve(torch.eye(4, dtype=torch.float64) - deq.func.a, u.T).T)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (c * z).sum().backward()
        exact = torch.linalg.solve(torch.eye(4, dtype=torch.float64) - deq.func.a.T, c.T).T
        if solver == "picard":
            assert [w.category for w in caught] == [DEQConvergenceWarning]
            assert not torch.allclose(u.grad, exact, rtol=1e-3)
        else:
            assert not caught and deq.adjoint_stats[1].converged and deq.ift_failure_fraction().item() == 0.0
            torch.testing.assert_close(u.grad, exact, rtol=1e-9, atol=1e-10)


def test_an_unknown_ift_solver_is_refused_at_construction():
    with pytest.raises(ValueError, match="DEQ ift_solver 'nope'"):
        DEQ(ExpandingMap(), backward="ift", ift_solver="nope")


@pytest.mark.parametrize("check_every", [1, 0])
def test_ift_failure_fraction_counts_backward_solves_that_missed_ift_tol(check_every):
    """Three backward solves capped at 2 iterations (they miss 1e-8), then one with room to converge: 3 of 4."""
    net = _make("ift", rho=0.9, ift_max_iter=2)
    net.deq.check_every, net.deq.warn_on_nonconvergence = check_every, False
    x = torch.randn(4, DIM, dtype=torch.float64)
    assert net.deq.ift_failure_fraction() is None
    for _ in range(3):
        net(x).pow(2).mean().backward()
    assert net.deq.ift_failure_fraction().item() == 1.0
    net.deq.ift_max_iter = 500
    net(x).pow(2).mean().backward()
    assert net.deq.ift_failure_fraction().item() == 0.75


class RecordingMap(TanhMap):
    """A :class:`TanhMap` that keeps a weak reference to every input that requires grad (the backward graph's)."""

    def __init__(self, dim):
        super().__init__(dim)
        self.inputs = []

    def forward(self, z, u):
        if z.requires_grad:
            self.inputs.append(weakref.ref(z))
        return super().forward(z, u)


@pytest.mark.parametrize("backward", ["ift", "phantom", "unroll"])
@pytest.mark.parametrize("run_backward", [True, False])
def test_a_step_frees_its_graph(backward, run_backward):
    # a graph kept alive by a reference cycle (e.g. a backward hook referring to its own tensor) grows memory
    # every training step; once the outputs are dropped, nothing of the layer's graph may survive
    torch.manual_seed(0)
    func = RecordingMap(DIM)
    deq = DEQ(func, solver="anderson", backward=backward, tol=1e-10, max_iter=100, warm_start=False)
    u = torch.randn(4, DIM, dtype=torch.float64, requires_grad=True)
    loss = deq(u).pow(2).sum()
    assert func.inputs and any(ref() is not None for ref in func.inputs)  # alive while the output is
    if run_backward:
        loss.backward()
    del loss
    gc.collect()
    assert all(ref() is None for ref in func.inputs)


@pytest.mark.parametrize("backward", ["phantom", "unroll", "ift"])
@pytest.mark.parametrize("order", [1, 2, 3])
def test_require_backward_refuses_exactly_the_orders_a_mode_cannot_differentiate(backward, order):
    class Map(nn.Module):
        def forward(self, z, u):
            return 0.5 * z + u

    model = nn.Sequential(nn.Identity(), DEQ(Map(), backward=backward))
    if backward == "ift" and order > 1:
        with pytest.raises(ConfigError, match=f"backward='ift' cannot be used with the loss X: it differentiates "
                                              f"through the DEQ {order} times"):
            require_backward(model, order, user="the loss X")
    else:
        require_backward(model, order, user="the loss X")
