"""A finite-width, weight-tied DEQ in the kernels' parameterisation, and its empirical tangent kernel.

:class:`FiniteDEQ` is the model of :mod:`.deq` at width N, built on :class:`deqscore.deq.DEQ` (so its backward mode
is the framework's: ``"ift"`` for the exact implicit gradient, ``"phantom"`` with K steps, ``"unroll"``). All
parameters are standard normal; the scales live in the forward (NTK parameterisation). :func:`empirical_ntk`
is the Gram matrix of the per-input parameter gradients of the output, the quantity that converges to
:func:`~.deq.deq_ntk` as N grows.

>>> import torch
>>> torch.manual_seed(0) and None
>>> net = FiniteDEQ(width=64, dim=3, sw2=0.5, su2=0.3, sb2=0.2, backward="ift")
>>> X = torch.nn.functional.normalize(torch.randn(2, 3, dtype=torch.float64), dim=1)
>>> G = empirical_ntk(net, X)
>>> G.shape, G.dtype, bool(torch.allclose(G, G.T))
(torch.Size([2, 2]), torch.float64, True)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deqscore.deq import DEQ

from .arccos import check_variances

Tensor = torch.Tensor
SQRT2 = math.sqrt(2.0)


def phi(u: Tensor) -> Tensor:
    """The normalised ReLU ``sqrt(2) max(0, u)``."""
    return SQRT2 * torch.relu(u)


class TiedMap(nn.Module):
    """``func(z, u) = sqrt(sw2 / N) W phi(z) + u``, the DEQ's fixed-point map with one weight W."""

    def __init__(self, width: int, sw2: float, dtype: torch.dtype):
        super().__init__()
        self.W = nn.Parameter(torch.randn(width, width, dtype=dtype))
        self.scale = math.sqrt(sw2 / width)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return self.scale * phi(z) @ self.W.T + u


class FiniteDEQ(nn.Module):
    """``F(x) = (sv / sqrt(N)) v^T phi(f*)``, ``f* = sqrt(sw2 / N) W phi(f*) + su U x + sb b``; ``deq_options``
    go to :class:`deqscore.deq.DEQ` (defaults: Anderson, relative tolerance 1e-10, float64)."""

    def __init__(self, width: int, dim: int, sw2: float, su2: float, sb2: float, sv2: float = 1.0,
                 dtype: torch.dtype = torch.float64, **deq_options):
        super().__init__()
        check_variances(sw2, su2, sb2, sv2)
        options = {"solver": "anderson", "tol": 1e-10, "stop_mode": "rel", "max_iter": 300, "ift_tol": 1e-11,
                   "ift_max_iter": 400, **deq_options}
        self.deq = DEQ(TiedMap(width, sw2, dtype), **options)
        self.U = nn.Parameter(torch.randn(width, dim, dtype=dtype))
        self.b = nn.Parameter(torch.randn(width, dtype=dtype))
        self.v = nn.Parameter(torch.randn(width, dtype=dtype))
        self.su, self.sb, self.sv = math.sqrt(su2), math.sqrt(sb2), math.sqrt(sv2)
        self.width = width

    def hidden(self, x: Tensor) -> Tensor:
        """``phi(f*)`` ``[n, N]``, the last hidden layer (through the DEQ's backward mode)."""
        return phi(self.deq(self.su * x @ self.U.T + self.sb * self.b))

    def forward(self, x: Tensor) -> Tensor:
        return self.sv / math.sqrt(self.width) * self.hidden(x) @ self.v


def empirical_nngp(net: FiniteDEQ, X: Tensor) -> Tensor:
    """``sv2 phi(f*(x)) . phi(f*(y)) / N``, the output covariance given the hidden layer (float64 ``[n, n]``); its
    mean over seeds tends to :func:`~.deq.deq_nngp`."""
    with torch.no_grad():
        H = net.hidden(X).to(torch.float64)
    return net.sv**2 * (H @ H.T) / net.width


def empirical_ntk(net: nn.Module, X: Tensor) -> Tensor:
    """``[n, n]`` Gram matrix of the parameter gradients of ``net(X)[i]`` (one backward per input, float64)."""
    params = [p for p in net.parameters() if p.requires_grad]
    out = net(X)
    grads = []
    for i in range(len(X)):
        g = torch.autograd.grad(out[i], params, retain_graph=i < len(X) - 1)
        grads.append(torch.cat([t.reshape(-1) for t in g]).to(torch.float64))
    G = torch.stack(grads)
    return G @ G.T
