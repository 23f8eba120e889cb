"""ReLU arc-cosine forms and the checks every kernel shares.

For the normalised ReLU ``phi(u) = sqrt(2) max(0, u)`` and a centred Gaussian pair of unit variances and
correlation ``rho``:

* ``k1(rho) = E[phi(u) phi(v)] = (sqrt(1 - rho^2) + (pi - arccos rho) rho) / pi``;
* ``k0(rho) = E[phi'(u) phi'(v)] = (pi - arccos rho) / pi`` (which is also ``dk1 / drho``).

>>> import torch
>>> rho = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64)
>>> [round(v, 4) for v in k1(rho).tolist()], [round(v, 4) for v in k0(rho).tolist()]
([0.0, 0.3183, 1.0], [0.0, 0.5, 1.0])
"""

from __future__ import annotations

import math

import torch

from deqscore.errors import ConfigError

Tensor = torch.Tensor
UNIT_NORM_TOL = 1e-6  # relative tolerance on the row norms of X and Y
VARIANCE_SUM_TOL = 1e-9  # tolerance on sw2 + su2 + sb2 = 1
# Input correlations within this of +-1 are taken as +-1: rounding in a dot product of unit rows leaves ~1e-16 per
# term, and the kernels have a square-root singularity at rho = 1 (arccos(1 - e) ~ sqrt(2 e)) that would turn 1e-16
# into a 1e-8 error on the diagonal.
SNAP_TOL = 1e-12


def k1(rho: Tensor) -> Tensor:
    """``E[phi(u) phi(v)]`` of the normalised ReLU at correlation ``rho`` (unit variances)."""
    rho = rho.clamp(-1.0, 1.0)
    return (torch.sqrt((1.0 - rho * rho).clamp_min(0.0)) + (math.pi - torch.arccos(rho)) * rho) / math.pi


def k0(rho: Tensor) -> Tensor:
    """``E[phi'(u) phi'(v)]`` of the normalised ReLU at correlation ``rho`` (unit variances)."""
    return (math.pi - torch.arccos(rho.clamp(-1.0, 1.0))) / math.pi


def check_variances(sw2: float, su2: float, sb2: float, sv2: float = 1.0) -> None:
    """Refuse variances for which the DEQ kernel is not defined: each finite and >= 0, ``sw2 < 1`` (the
    fixed-point map of the correlations contracts at rate ``sw2``), ``sw2 + su2 + sb2 = 1`` (the diagonal stays
    1, which the arc-cosine forms assume) and ``sv2 > 0``.

    >>> check_variances(0.5, 0.3, 0.3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    deqscore.errors.ConfigError: DEQ kernel variances must satisfy sw2 + su2 + sb2 = 1 ...
    """
    for key, value in (("sw2", sw2), ("su2", su2), ("sb2", sb2), ("sv2", sv2)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"DEQ kernel {key} must be a finite number >= 0, got {value!r}")
    if sw2 >= 1:
        raise ConfigError(f"DEQ kernel sw2 must be < 1 (the map of the correlations contracts at rate sw2), got {sw2}")
    if abs(sw2 + su2 + sb2 - 1.0) > VARIANCE_SUM_TOL:
        raise ConfigError(
            f"DEQ kernel variances must satisfy sw2 + su2 + sb2 = 1 (unit diagonal), got {sw2} + {su2} + {sb2} = "
            f"{sw2 + su2 + sb2}"
        )
    if sv2 == 0:
        raise ConfigError("DEQ kernel sv2 must be > 0, got 0")


def unit_rows(name: str, X: Tensor) -> Tensor:
    """``X`` as a float64 ``[n, d]`` tensor, refused unless every row has unit L2 norm (within 1e-6).

    >>> unit_rows("X", torch.tensor([[3.0, 4.0]]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    deqscore.errors.ConfigError: DEQ kernel input X must have rows of unit L2 norm ...
    """
    X = torch.as_tensor(X)
    if X.dim() != 2:
        raise ConfigError(f"DEQ kernel input {name} must be a [n, d] matrix, got shape {tuple(X.shape)}")
    X = X.to(torch.float64)
    norms = X.norm(dim=1)
    bad = (norms - 1.0).abs() > UNIT_NORM_TOL
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ConfigError(
            f"DEQ kernel input {name} must have rows of unit L2 norm (the kernels assume a unit diagonal); row {i} "
            f"has norm {float(norms[i]):.6g} ({int(bad.sum())} of {len(X)} rows off). Normalise with "
            f"X / X.norm(dim=1, keepdim=True)"
        )
    return X / norms[:, None]


def input_correlation(X: Tensor, Y: Tensor) -> Tensor:
    """``X Y^T`` of checked unit rows (renormalised), clamped to [-1, 1] and snapped to +-1 within ``SNAP_TOL``.

    >>> x = torch.nn.functional.normalize(torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64), dim=1)
    >>> input_correlation(x, x).item()
    1.0
    """
    X, Y = unit_rows("X", X), unit_rows("Y", Y)
    if X.shape[1] != Y.shape[1]:
        raise ConfigError(f"DEQ kernel inputs X and Y must have the same dimension, got {X.shape[1]} and {Y.shape[1]}")
    c = X @ Y.T
    if c.shape[0] == c.shape[1] and torch.equal(X, Y):  # a Gram matrix: symmetric to the last bit
        c = 0.5 * (c + c.T)
    c = c.clamp(-1.0, 1.0)
    return torch.where((c.abs() - 1.0).abs() <= SNAP_TOL, c.sign(), c)
