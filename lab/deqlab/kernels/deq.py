"""The infinite-width kernels of a fully connected DEQ: DEQ-NNGP and DEQ-NTK, exact or with K phantom steps.

The model (NTK parameterisation, width N, unit-norm inputs, ``phi(u) = sqrt(2) max(0, u)``)::

    f* = sqrt(sw2 / N) W phi(f*) + su U x + sb b,        F(x) = (sv / sqrt(N)) v^T phi(f*)

with ``sw2 + su2 + sb2 = 1``. As N grows, the pre-activations of a pair (x, y) become Gaussian with unit
variances and a correlation ``rho*`` that solves ``rho = R(rho) = sw2 k1(rho) + su2 x.y + sb2``; the map R
contracts at rate ``sw2 k0 <= sw2 < 1``, so the root is unique. With ``Sdot* = sw2 k0(rho*)``:

* NNGP: ``K*(x, y) = sv2 k1(rho*)``;
* NTK: ``Theta*(x, y) = sv2 (k1(rho*) + k0(rho*) rho* / (1 - Sdot*))``, diagonal ``sv2 (1 + 1 / (1 - sw2))``;
* K phantom steps from the detached fixed point: ``sv2 (k1 + k0 rho* (1 - Sdot*^K) / (1 - Sdot*))``.

>>> import torch
>>> X = torch.eye(3, dtype=torch.float64)
>>> K = deq_ntk(X, X, sw2=0.5, su2=0.3, sb2=0.2)
>>> round(float(K[0, 0]), 6), bool(torch.allclose(K, K.T))
(3.0, True)
>>> bool((deq_ntk(X, X, 0.5, 0.3, 0.2, phantom_steps=2) < K).all())
True
"""

from __future__ import annotations

import torch

from deqscore.errors import check_count

from .arccos import check_variances, input_correlation, k0, k1

Tensor = torch.Tensor
NEWTON_MAX_ITER = 60
NEWTON_TOL = 1e-14


def fixed_point_correlation(c: Tensor, sw2: float, su2: float, sb2: float) -> Tensor:
    """``rho*``, the root of ``sw2 k1(rho) + su2 c + sb2 - rho`` for every input correlation ``c`` at once.

    Pairs with ``c = 1`` get ``rho* = 1`` exactly (``R(1) = 1``): Newton would stop within rounding of 1, where
    ``k0`` has a square-root singularity that turns 1e-16 into 1e-8. Newton's method in float64 from
    ``rho0 = su2 c + sb2``: ``g(rho) = R(rho) - rho`` is convex (``k1'' >= 0``) and decreasing
    (``g' = sw2 k0 - 1 < 0``), and ``g(rho0) = sw2 k1(rho0) >= 0``, so the iterates rise
    monotonically to the root (quadratically near it).

    >>> c = torch.tensor([1.0, 0.0], dtype=torch.float64)
    >>> rho = fixed_point_correlation(c, 0.5, 0.3, 0.2)
    >>> float(rho[0]), bool(abs(0.5 * k1(rho[1]) + 0.2 - rho[1]) < 1e-14)
    (1.0, True)
    """
    check_variances(sw2, su2, sb2)
    c = c.to(torch.float64)
    base = su2 * c + sb2
    rho = base.clone()
    for _ in range(NEWTON_MAX_ITER):
        g = sw2 * k1(rho) + base - rho
        step = g / (1.0 - sw2 * k0(rho))
        rho = (rho + step).clamp(-1.0, 1.0)
        if step.numel() == 0 or float(step.abs().max()) <= NEWTON_TOL:
            break
    return torch.where(c == 1.0, torch.ones_like(rho), rho)


def _fixed_point(X: Tensor, Y: Tensor, sw2: float, su2: float, sb2: float, sv2: float) -> Tensor:
    check_variances(sw2, su2, sb2, sv2)
    return fixed_point_correlation(input_correlation(X, Y), sw2, su2, sb2)


def deq_nngp(X: Tensor, Y: Tensor, sw2: float, su2: float, sb2: float, sv2: float = 1.0) -> Tensor:
    """The DEQ-NNGP ``sv2 k1(rho*)``: float64 ``[n, m]`` for unit-norm rows ``X`` ``[n, d]`` and ``Y`` ``[m, d]``.

    >>> X = torch.eye(2, dtype=torch.float64)
    >>> deq_nngp(X, X, 0.5, 0.3, 0.2).diagonal().tolist()
    [1.0, 1.0]
    """
    return sv2 * k1(_fixed_point(X, Y, sw2, su2, sb2, sv2))


def deq_ntk(
    X: Tensor, Y: Tensor, sw2: float, su2: float, sb2: float, sv2: float = 1.0, phantom_steps: int | None = None
) -> Tensor:
    """The DEQ-NTK, float64 ``[n, m]`` for unit-norm rows ``X`` ``[n, d]`` and ``Y`` ``[m, d]``.

    ``phantom_steps=None``: the exact (implicit-gradient) kernel ``sv2 (k1 + k0 rho* / (1 - Sdot*))``;
    ``phantom_steps=K``: the tangent kernel of K undamped phantom steps from the detached fixed point,
    ``sv2 (k1 + k0 rho* (1 - Sdot*^K) / (1 - Sdot*))``, which tends to the exact one as K grows.

    >>> X = torch.eye(2, dtype=torch.float64)
    >>> deq_ntk(X, X, 0.5, 0.3, 0.2, phantom_steps=1).diagonal().tolist()
    [2.0, 2.0]
    """
    rho = _fixed_point(X, Y, sw2, su2, sb2, sv2)
    kappa0, kappa1 = k0(rho), k1(rho)
    sdot = sw2 * kappa0
    if phantom_steps is None:
        geometric = 1.0 / (1.0 - sdot)
    else:
        check_count("DEQ kernel phantom_steps", phantom_steps)
        geometric = (1.0 - sdot**phantom_steps) / (1.0 - sdot)
    return sv2 * (kappa1 + kappa0 * rho * geometric)


def ntk_diagonal(sw2: float, sv2: float = 1.0) -> float:
    """The closed-form diagonal ``Theta*(x, x) = sv2 (1 + 1 / (1 - sw2))`` of the exact DEQ-NTK.

    >>> ntk_diagonal(0.5)
    3.0
    """
    return sv2 * (1.0 + 1.0 / (1.0 - sw2))
