"""The DEQ layer without host syncs (``check_every``) and under autocast: the same fixed point and gradients as the
default solve with the same iterations, statistics kept on the device, non-convergence counted and warned when
read; float32 solves under bfloat16 autocast."""

import warnings

import pytest
import torch
from torch import nn

from deqscore.deq import DEQ, DEQConvergenceWarning, get_solver
from deqscore.errors import ConfigError
from deqscore.finite import DeferredChecks, deferred_checks, require_finite


class Map(nn.Module):
    def __init__(self, d: int = 6, scale: float = 0.6):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(d, d)
        self.scale = scale

    def forward(self, z, u):
        return torch.tanh(self.scale * self.lin(z) / self.lin.weight.norm() + u)


def _solve(name, check_every, max_iter, tol):
    f = Map()
    u = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return get_solver(name)(lambda z: f(z, u), torch.zeros_like(u), tol=tol, max_iter=max_iter,
                                check_every=check_every)


@pytest.mark.parametrize("name", ["picard", "anderson", "broyden"])
def test_never_checked_solve_equals_the_checked_one_with_the_same_iterations(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z1, s1 = _solve(name, 1, 9, tol=1e-30)  # a tolerance never met: 9 iterations in both
    z0, s0 = _solve(name, 0, 9, tol=1e-30)
    assert s1.nstep == s0.nstep == 9
    assert torch.equal(z0, z1)
    assert isinstance(s0.abs_residual, torch.Tensor) and s0.deferred and not s1.deferred
    assert s0.resolved().abs_residual == pytest.approx(s1.abs_residual, rel=1e-6)
    assert s0.resolved().converged is False


@pytest.mark.parametrize("name", ["picard", "anderson", "broyden"])
def test_checked_every_k_stops_at_the_first_multiple_of_k_after_convergence(name):
    _, every = _solve(name, 1, 100, tol=1e-6)
    _, k3 = _solve(name, 3, 100, tol=1e-6)
    expected = -(-every.nstep // 3) * 3  # the first check at or after the iteration that met tol
    assert k3.nstep == expected and bool(k3.converged)
    assert k3.resolved().abs_residual < 1e-6


def test_check_every_must_be_a_count():
    with pytest.raises(ConfigError, match="check_every"):
        DEQ(Map(), check_every=-1)


def _layer_grads(check_every, backward, max_iter=12, ift_max_iter=15, tol=1e-30):
    layer = DEQ(Map(), solver="anderson", max_iter=max_iter, tol=tol, backward=backward, ift_max_iter=ift_max_iter,
                ift_tol=1e-30, check_every=check_every)
    u = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = layer(u)
        z.pow(2).sum().backward()
    return layer, z.detach(), u.grad, [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("backward", ["phantom", "ift"])
def test_sync_free_layer_gives_the_default_output_and_gradients(backward):
    _, z1, gu1, gp1 = _layer_grads(1, backward)
    layer, z0, gu0, gp0 = _layer_grads(0, backward)
    assert torch.allclose(z0, z1, rtol=0, atol=1e-7) and torch.allclose(gu0, gu1, rtol=1e-6, atol=1e-8)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(gp0, gp1, strict=True))
    assert layer.stats.deferred


def test_non_convergence_is_counted_on_the_device_and_warned_once_when_read():
    layer = DEQ(Map(scale=0.99), solver="picard", max_iter=2, tol=1e-12, backward="ift", ift_max_iter=2,
                ift_tol=1e-12, check_every=0)
    u = torch.randn(4, 6, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing warned while solving
        for _ in range(3):
            layer(u).sum().backward()
    with pytest.warns(DEQConvergenceWarning, match="3 of 3 solves") as record:
        counts = layer.read_deferred()
    assert len(record) == 1
    assert counts == {"solves": 3.0, "unconverged": 3.0, "backward_failures": 3.0}
    assert layer.read_deferred() == {}  # read: emptied


def test_converged_deferred_solves_are_not_warned():
    layer = DEQ(Map(), solver="anderson", max_iter=40, tol=1e-5, check_every=0)
    layer(torch.randn(4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert layer.read_deferred() == {"solves": 1.0, "unconverged": 0.0}


@pytest.mark.parametrize("solver", ["anderson", "broyden", "picard"])
@pytest.mark.parametrize("backward", ["phantom", "ift", "unroll"])
def test_the_solve_runs_in_float32_under_bfloat16_autocast(solver, backward):
    # Anderson's linalg.solve_ex has no bfloat16 kernel; a bfloat16 residual cannot meet tol 1e-5. The injection
    # comes in bfloat16, as from an autocast layer before the DEQ.
    layer = DEQ(Map(), solver=solver, max_iter=60, tol=1e-5, backward=backward)
    u = torch.randn(4, 6).to(torch.bfloat16).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("error", DEQConvergenceWarning)
        z = layer(u)
        z.float().pow(2).sum().backward()
    assert layer.stats.converged
    assert torch.isfinite(u.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())
    # the float32 fixed point, to bfloat16 accuracy where the phantom steps ran in bfloat16
    with torch.no_grad():
        z32 = DEQ(Map(), solver=solver, max_iter=60, tol=1e-5, backward="phantom")(u.float())
    assert torch.allclose(z.float(), z32, atol=2e-2)


def test_phantom_steps_run_under_the_surrounding_autocast():
    layer = DEQ(Map(), solver="anderson", tol=1e-5)
    lin_dtypes = []
    layer.func.lin.register_forward_hook(lambda m, i, o: lin_dtypes.append((torch.is_grad_enabled(), o.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(4, 6, requires_grad=True))
    assert {d for grad, d in lin_dtypes if not grad} == {torch.float32}  # the solve
    assert [d for grad, d in lin_dtypes if grad] == [torch.bfloat16] * layer.phantom_steps


def test_deferred_checks_collect_instead_of_raising():
    bad = torch.tensor([1.0, float("inf"), float("nan")])
    with pytest.raises(ValueError, match="2 bad"):
        require_finite(bad, lambda n: ValueError(f"{n} bad"))
    checks = DeferredChecks()
    with deferred_checks(checks):
        require_finite(bad, lambda n: ValueError(f"{n} bad"), what="x")
        require_finite(torch.ones(3), lambda n: ValueError(f"{n} bad"), what="y")
    assert checks.read() == ["x"] and len(checks) == 0
