"""Reference kernels of finite-depth fully connected ReLU networks with untied weights, with or without injection.

Layer 0 reads the input, ``h^0 = U_0 x``; layers ``l = 1..L`` are ``h^l = sqrt(a / N) W_l phi(h^{l-1}) + sqrt(b) U_l x
+ sqrt(e) b_l`` with ``(a, b, e) = (sw2, su2, sb2)`` *with injection* (the DEQ's map, unrolled with fresh weights
per layer) and ``(1, 0, 0)`` *without* (a plain deep ReLU net). The output is ``F = (sv / sqrt(N)) v^T phi(h^L)``.
At infinite width the correlations and the hidden tangent kernel follow

    rho^0 = Theta^0 = x.y,   rho^l = a k1(rho^{l-1}) + b x.y + e,   Theta^l = rho^l + a k0(rho^{l-1}) Theta^{l-1}

and ``NNGP = sv2 k1(rho^L)``, ``NTK = sv2 (k1(rho^L) + k0(rho^L) Theta^L)``. With injection the recursion is
Picard's iteration on the DEQ's fixed point, so both kernels converge to :func:`~.deq.deq_nngp` and
:func:`~.deq.deq_ntk` as L grows (geometrically, at rate ``<= sw2``); without it every correlation tends to 1:
a deep net forgets its input.

>>> import torch
>>> X = torch.eye(2, dtype=torch.float64)
>>> from deqlab.kernels.deq import deq_ntk
>>> deep = finite_depth_kernels(X, X, [60], 0.5, 0.3, 0.2)[60][1]
>>> bool(torch.allclose(deep, deq_ntk(X, X, 0.5, 0.3, 0.2), atol=1e-12))
True
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deqscore.errors import ConfigError, check_count

from .arccos import check_variances, input_correlation, k0, k1

Tensor = torch.Tensor


def layer_variances(sw2: float, su2: float, sb2: float, injection: bool) -> tuple[float, float, float]:
    """``(a, b, e)`` of layers 1..L: the DEQ's variances with injection, ``(1, 0, 0)`` without.

    >>> layer_variances(0.5, 0.3, 0.2, injection=False)
    (1.0, 0.0, 0.0)
    """
    return (sw2, su2, sb2) if injection else (1.0, 0.0, 0.0)


def finite_depth_kernels(
    X: Tensor, Y: Tensor, depths: Iterable[int], sw2: float, su2: float, sb2: float, sv2: float = 1.0,
    injection: bool = True,
) -> dict[int, tuple[Tensor, Tensor]]:
    """``{L: (NNGP, NTK)}`` (float64 ``[n, m]``) of the depth-L network for every L in ``depths``, from one pass
    of the recursion to the largest depth. Without injection only ``sv2`` of the variances is used (the layers
    are ``(1, 0, 0)``), but the others are still checked.

    >>> X = torch.eye(2, dtype=torch.float64)
    >>> out = finite_depth_kernels(X, X, [1, 50], 0.5, 0.3, 0.2, injection=False)
    >>> round(float(out[1][0][0, 1]), 4) < round(float(out[50][0][0, 1]), 4) < 1.0
    True
    """
    check_variances(sw2, su2, sb2, sv2)
    wanted = sorted(set(depths))
    if not wanted:
        raise ConfigError("finite-depth kernel depths must name at least one depth")
    for L in wanted:
        check_count("finite-depth kernel depth", L, low=0)
    a, b, e = layer_variances(sw2, su2, sb2, injection)
    c = input_correlation(X, Y)
    rho, theta = c.clone(), c.clone()
    out: dict[int, tuple[Tensor, Tensor]] = {}
    for layer in range(wanted[-1] + 1):
        if layer > 0:
            rho, theta = _layer(rho, theta, c, a, b, e)
        if layer in wanted:
            out[layer] = (sv2 * k1(rho), sv2 * (k1(rho) + k0(rho) * theta))
    return out


def _layer(rho: Tensor, theta: Tensor, c: Tensor, a: float, b: float, e: float) -> tuple[Tensor, Tensor]:
    """One layer of the recursion: the new correlation and hidden tangent kernel."""
    new_rho = a * k1(rho) + b * c + e
    return new_rho, new_rho + a * k0(rho) * theta


def finite_depth_ntk(
    X: Tensor, Y: Tensor, depth: int, sw2: float, su2: float, sb2: float, sv2: float = 1.0, injection: bool = True
) -> Tensor:
    """The NTK of the depth-``depth`` network (see :func:`finite_depth_kernels`).

    >>> X = torch.eye(2, dtype=torch.float64)
    >>> finite_depth_ntk(X, X, 0, 0.5, 0.3, 0.2).diagonal().tolist()  # layer 0 only: k1 + k0 * 1
    [2.0, 2.0]
    """
    return finite_depth_kernels(X, Y, [depth], sw2, su2, sb2, sv2, injection)[depth][1]


def finite_depth_nngp(
    X: Tensor, Y: Tensor, depth: int, sw2: float, su2: float, sb2: float, sv2: float = 1.0, injection: bool = True
) -> Tensor:
    """The NNGP of the depth-``depth`` network (see :func:`finite_depth_kernels`)."""
    return finite_depth_kernels(X, Y, [depth], sw2, su2, sb2, sv2, injection)[depth][0]


def normalised(K: Tensor, diag_x: Tensor, diag_y: Tensor) -> Tensor:
    """``K(x, y) / sqrt(K(x, x) K(y, y))``, the kernel's correlation.

    >>> normalised(torch.tensor([[2.0]]), torch.tensor([4.0]), torch.tensor([1.0]))
    tensor([[1.]])
    """
    return K / torch.sqrt(diag_x[:, None] * diag_y[None, :])
