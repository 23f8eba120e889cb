"""DKEF's feature networks (shallow MLP, deep MLP, DEQ) and the closed-form derivatives of its Gaussian kernels from
those of the features (docs/method.md section 3.7): with ``r = phi(x) - phi(z_m)``, ``s = 10^l``, ``J = d phi / dx``,
``grad k = -(k/s) J^T r`` and ``lap k = (k/s^2) ||J^T r||^2 - (k/s) (||J||_F^2 + r . lap phi)``."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..deq import DEQFactory, frobenius_scale


class DKEFDEQMap(nn.Module):
    """Linear fixed-point map of the DEQ feature net: ``F(z, u) = W z / w + u``, ``W`` h x h without bias.

    ``w = (1 + 1e-6) (||W||_F + 1e-6)``, recomputed from the current weight on every call, so ``||W / w||_2 < 1``
    and ``F`` is a contraction in ``z`` (docs/method.md section 2.2); ``grad_through_norm`` decides whether
    autograd differentiates ``w``.
    """

    additive_injection = True  # f(z, u) = h(z) + u: the implicit backward saves no copy of u

    def __init__(self, hidden: int, grad_through_norm: bool = False):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden, bias=False)
        self.grad_through_norm = grad_through_norm

    def scaled_weight(self) -> Tensor:
        """``W / w``."""
        return frobenius_scale(self.lin.weight, c=1 + 1e-6, eps=1e-6, grad_through_norm=self.grad_through_norm)

    def affine_weight(self) -> Tensor:
        """``W / w``: the map is linear in ``z``, so ``DEQ(backward="implicit")`` solves it directly,
        ``z* = u (I - W^T / w)^{-1}`` (one batched linear solve)."""
        return self.scaled_weight()

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return F.linear(z, self.scaled_weight()) + u


class DEQFeatureBody(nn.Module):
    """DEQ feature body: ``u = SP(Linear(d, h) x)``, output the fixed point ``z* = W z* / w + u``."""

    def __init__(self, dim: int, hidden: int, deq: DEQFactory, grad_through_norm: bool = False):
        super().__init__()
        self.inject = nn.Linear(dim, hidden)
        self.deq = deq(DKEFDEQMap(hidden, grad_through_norm))

    def injection(self, x: Tensor) -> Tensor:
        return F.softplus(self.inject(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.deq(self.injection(x))


def softplus_mlp(dims: list[int]) -> nn.Sequential:
    """Linear layers ``dims[0] -> dims[1] -> ...`` with Softplus between them (none after the last)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        if i:
            layers.append(nn.Softplus())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


class DKEFFeatureNet(nn.Module):
    """Feature map ``phi(x) = body(x) + skip(x)`` with a bias-free ``skip = Linear(dim, hidden)``.

    ``body``: ``"shallow"`` Linear(d,h) SP Linear(h,h) SP Linear(h,h); ``"deep"`` Linear(d,h) then
    ``deep_layers - 1`` times [SP, Linear(h,h)]; ``"deq"`` :class:`DEQFeatureBody`.
    """

    def __init__(self, dim: int, hidden: int, kind: str, deep_layers: int, deq: DEQFactory,
                 grad_through_norm: bool):
        super().__init__()
        if kind == "shallow":
            self.body: nn.Module = softplus_mlp([dim, hidden, hidden, hidden])
        elif kind == "deep":
            self.body = softplus_mlp([dim] + [hidden] * deep_layers)
        else:
            self.body = DEQFeatureBody(dim, hidden, deq, grad_through_norm)
        self.skip = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) + self.skip(x)


class _FeatureDerivs(NamedTuple):
    """Per-sample features ``f = phi(x)`` [B, h] and the input derivatives asked for."""

    f: Tensor
    cols: Tensor | None  # [D, B, h]: J e_d, the Jacobian columns
    lap: Tensor | None  # [B, h]: sum_d d^2 phi / dx_d^2
    fv: Tensor | None  # [B, h]: J v
    fvv: Tensor | None  # [B, h]: v^T (d^2 phi / dx^2) v, per feature


class _KernelDerivs(NamedTuple):
    """Input derivatives of the kernel mixture ``k(x) = sum_j pi_j k_j(x, z_.)`` [B, M]."""

    grad: Tensor | None  # [D, B, M]: d k / d x_d
    lap: Tensor | None  # [B, M]: Laplacian
    gv: Tensor | None  # [B, M]: grad k . v
    vhv: Tensor | None  # [B, M]: v^T hess k v


def _grad(out: Tensor, inp: Tensor, grad_outputs: Tensor | None = None, batched: bool = False) -> Tensor:
    """``d out / d inp`` with ``create_graph=True``; an unused input gives zeros."""
    (g,) = torch.autograd.grad(out, inp, grad_outputs, create_graph=True, is_grads_batched=batched,
                               materialize_grads=True)
    return g


def _unit_directions(n: int, like: Tensor) -> Tensor:
    """``[n, B, n]``: the n unit vectors, the same for every sample (grad outputs of a batched pass)."""
    eye = torch.eye(n, dtype=like.dtype, device=like.device)
    return eye[:, None, :].expand(n, like.shape[0], n)


def _jacobian_columns(f: Tensor, x: Tensor, g: Tensor, u: Tensor) -> Tensor:
    """``[D, B, h]`` columns of ``J = d f / d x`` with ``min(D, h)`` batched passes; ``g = J^T u`` is linear in u."""
    d, h = x.shape[1], f.shape[1]
    if d <= h:  # J e_d = d (J^T u . e_d) / du
        return _grad(g, u, _unit_directions(d, x), batched=True)
    return _grad(f, x, _unit_directions(h, f), batched=True).permute(2, 1, 0)  # rows of J, transposed


def feature_derivatives(phi: nn.Module, x: Tensor, cols: bool, lap: bool, v: Tensor | None) -> _FeatureDerivs:
    """Features of ``x`` (a leaf requiring grad) and their input derivatives, all with ``create_graph=True``.

    Forward-mode quantities come from the double-backward trick: ``g = J^T u`` with a dummy ``u`` is linear in
    ``u``, so ``d(g . a)/du = J a``. ``lap``: ``u . lap phi = tr(d g / d x)`` (one D-batched pass), then ``d/du``.
    ``v``: ``u^T (H v) = d(g . v)/dx``, so ``v^T H v = d((d(g . v)/dx) . v)/du``. Samples must not interact.
    """
    f = phi(x)
    u = torch.zeros_like(f, requires_grad=True)
    g = _grad(f, x, u)  # [B, D] = J^T u
    out_cols = _jacobian_columns(f, x, g, u) if cols else None
    out_lap = None
    if lap:
        hess_g = _grad(g, x, _unit_directions(x.shape[1], x), batched=True)  # [D, B, D]: rows of d g / dx
        out_lap = _grad(hess_g.diagonal(dim1=0, dim2=2).sum(), u)
    fv = fvv = None
    if v is not None:
        gv = (g * v).sum()
        fv, hv = _grad(gv, u), _grad(gv, x)
        fvv = _grad((hv * v).sum(), u)
    return _FeatureDerivs(f, out_cols, out_lap, fv, fvv)


def _dot_residual(t: Tensor, f: Tensor, c: Tensor) -> Tensor:
    """``(f_b - c_m) . t_b`` for ``t`` [..., B, h], ``f`` [B, h], ``c`` [M, h]: [..., B, M], no [B, M, h] tensor."""
    return (t * f).sum(-1, keepdim=True) - t @ c.T


def _gauss_kernel(f: Tensor, c: Tensor, scale: Tensor) -> Tensor:
    """``exp(-||f_b - c_m||^2 / (2 scale))`` [B, M], by the expansion ``|f|^2 + |c|^2 - 2 f.c``.

    At a point equal to a centre the expansion rounds to a tiny negative number. Its value is clamped at zero, but
    its derivatives are those of the expansion: a clamp's zero gradient there would drop the kernel's second
    derivative (its ``||J||^2`` term) at every centre, and centres are drawn from the training data.
    """
    sq = f.pow(2).sum(1, keepdim=True) + c.pow(2).sum(1) - 2 * f @ c.T
    sq = sq + (sq.clamp_min(0) - sq).detach()
    return torch.exp(-sq / (2 * scale))


def _one_kernel_derivs(fd: _FeatureDerivs, c: Tensor, s: Tensor) -> _KernelDerivs:
    """Closed-form input derivatives of one Gaussian kernel from those of its features (module docstring)."""
    k = _gauss_kernel(fd.f, c, s)
    grad = lap = gv = vhv = None
    if fd.cols is not None:
        a = _dot_residual(fd.cols, fd.f, c)  # [D, B, M]: r . J e_d
        grad = -k / s * a
        if fd.lap is not None:
            jac_sq = fd.cols.pow(2).sum((0, 2)).unsqueeze(1)  # ||J||_F^2, [B, 1]
            lap = k / s**2 * a.pow(2).sum(0) - k / s * (jac_sq + _dot_residual(fd.lap, fd.f, c))
    if fd.fv is not None:
        av = _dot_residual(fd.fv, fd.f, c)  # [B, M]: r . J v
        gv = -k / s * av
        vhv = k / s**2 * av.pow(2) - k / s * (fd.fv.pow(2).sum(1, keepdim=True) + _dot_residual(fd.fvv, fd.f, c))
    return _KernelDerivs(grad, lap, gv, vhv)


def _weighted_sum(parts: list[Tensor | None], weights: Tensor) -> Tensor | None:
    if parts[0] is None:
        return None
    return sum(w * p for w, p in zip(weights, parts, strict=True))
