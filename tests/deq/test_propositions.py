"""The implicit derivatives of docs/method.md section 2.6 (Prop. 1, eqs. 8-9), in closed form, against autograd
through a DEQ."""

import torch
import torch.nn.functional as F
from torch import nn

from deqscore.deq import DEQ

N, M = 6, 3  # state and input dimensions


class SoftplusMap(nn.Module):
    """``f(z, y) = softplus(W z + g(y))`` with ``g(y) = tanh(A y)``; the DEQ layer gets ``u = g(y)``."""

    def __init__(self, rho: float = 0.6):
        super().__init__()
        w = torch.randn(N, N, dtype=torch.float64)
        self.w = nn.Parameter(w / torch.linalg.matrix_norm(w, ord=2) * rho)
        self.a = nn.Parameter(torch.randn(N, M, dtype=torch.float64))

    def g(self, y):
        return torch.tanh(y @ self.a.T)

    def forward(self, z, u):
        return F.softplus(z @ self.w.T + u)


def _closed_form(fmap, y):
    """z*, dz*/dy (eq. 8) and d2z*/dy_i dy_j (eq. 9) for one input y [M]."""
    deq = DEQ(fmap, solver="broyden", tol=1e-13, max_iter=500)
    with torch.no_grad():
        z = deq(fmap.g(y[None]))[0]
        w = fmap.w
        g_jac = torch.autograd.functional.jacobian(lambda v: fmap.g(v[None])[0], y)  # [N, M]
        g_second = torch.stack([
            torch.autograd.functional.hessian(lambda v, k=k: fmap.g(v[None])[0, k], y) for k in range(N)
        ])  # [N, M, M]
        a = z @ w.T + fmap.g(y[None])[0]
        d1, d2 = torch.sigmoid(a), torch.sigmoid(a) * (1 - torch.sigmoid(a))  # softplus', softplus''
        inv = torch.linalg.inv(torch.eye(N, dtype=y.dtype) - d1[:, None] * w)  # (I - J)^-1, J = D W
        dz = inv @ (d1[:, None] * g_jac)  # eq. 8: (I - J)^-1 B, B = D dg/dy
        d2z = torch.empty(N, M, M, dtype=y.dtype)
        for i in range(M):
            for j in range(M):
                lin_i, lin_j = w @ dz[:, i] + g_jac[:, i], w @ dz[:, j] + g_jac[:, j]
                bracket = d2 * lin_i * lin_j + d1 * g_second[:, i, j]
                d2z[:, i, j] = inv @ bracket  # eq. 9
    return z, dz, d2z


def test_first_and_second_implicit_derivatives_match_eqs_8_and_9():
    torch.manual_seed(0)
    fmap = SoftplusMap()
    y = torch.randn(M, dtype=torch.float64)
    z, dz, d2z = _closed_form(fmap, y)
    exact = DEQ(fmap, backward="unroll", solver="picard", tol=1e-14, max_iter=400)
    z_of_y = lambda v: exact(fmap.g(v[None]))[0]  # noqa: E731
    assert torch.allclose(z_of_y(y), z, atol=1e-12)
    assert torch.allclose(torch.autograd.functional.jacobian(z_of_y, y), dz, atol=1e-10)
    for k in range(N):
        hess = torch.autograd.functional.hessian(lambda v, k=k: z_of_y(v)[k], y)
        assert torch.allclose(hess, d2z[k], atol=1e-9), k


def test_phantom_second_derivatives_converge_to_eq_9():
    torch.manual_seed(1)
    fmap = SoftplusMap(rho=0.5)
    y = torch.randn(M, dtype=torch.float64)
    _, _, d2z = _closed_form(fmap, y)
    errors = []
    for k_steps in (1, 2, 4, 8, 16):
        deq = DEQ(fmap, solver="anderson", tol=1e-13, max_iter=500, phantom_steps=k_steps)
        hess = torch.stack([
            torch.autograd.functional.hessian(lambda v, k=k, deq=deq: deq(fmap.g(v[None]))[0, k], y) for k in range(N)
        ])
        errors.append(((hess - d2z).norm() / d2z.norm()).item())
    assert all(b < a for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[0] > 1e-2 and errors[-1] < 1e-5, errors
