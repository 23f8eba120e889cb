"""NICE: additive coupling flow with a learned diagonal scale, with explicit or DEQ coupling networks.

The flow works on vectors of dimension D (784 for MNIST in logit space). Coupling ``i`` adds ``m_i`` of one
half (even or odd coordinates, alternating) to the other half; a final diagonal scale gives
``y = exp(s) * h``. In nats, ``log p(x) = -(D/2) log 2 pi - 0.5 ||y||^2 + sum(s)`` (coupling log-dets are 0).

>>> import torch
>>> flow = NICE(dim=6, n_couplings=2, hidden=8, n_layers=3).double()
>>> x = torch.randn(4, 6, dtype=torch.float64)
>>> bool(torch.allclose(flow.inverse(flow(x)), x))
True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..deq import DEQ
from ..errors import ConfigError, choice_error

DEQFactory = Callable[[nn.Module], DEQ]  # DEQ options bound, the fixed-point map still to come

M_NETS = ("explicit", "deq")


def explicit_mlp(d_in: int, hidden: int, n_layers: int, d_out: int) -> nn.Sequential:
    """``n_layers`` Linear layers, Softplus between: ``d_in -> hidden x (n_layers-1) -> d_out``."""
    if n_layers < 2:
        raise ConfigError(f"an explicit m-net needs n_layers >= 2, got {n_layers}")
    dims = [d_in] + [hidden] * (n_layers - 1) + [d_out]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.Softplus())
    return nn.Sequential(*layers)


class NICEDEQMap(nn.Module):
    """Fixed-point map of the DEQ m-net: ``F(z, u) = a * SP(W2 SP(W1 z + b1) + b2) / w + u``.

    ``w = (1 + 1e-6) (||W1||_F ||W2||_F + 1e-12)`` is recomputed from the current weights on every call, so
    ``F`` is an ``a``-contraction in ``z`` (Softplus is 1-Lipschitz, spectral <= Frobenius norm).
    """

    def __init__(self, hidden: int, scale: float = 0.5, grad_through_norm: bool = True):
        super().__init__()
        self.lin1 = nn.Linear(hidden, hidden)
        self.lin2 = nn.Linear(hidden, hidden)
        self.scale, self.grad_through_norm = scale, grad_through_norm

    def norm_scalar(self) -> torch.Tensor:
        w = (1 + 1e-6) * (self.lin1.weight.norm() * self.lin2.weight.norm() + 1e-12)
        return w if self.grad_through_norm else w.detach()

    def forward(self, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        h = F.softplus(self.lin2(F.softplus(self.lin1(z))))
        return self.scale * h / self.norm_scalar() + u


class DEQMNet(nn.Module):
    """DEQ coupling network: ``u = SP(Linear(x1))``, ``z* = F(z*, u)``, output ``Linear(z*)``."""

    def __init__(self, d_in: int, hidden: int, d_out: int, deq: DEQFactory = DEQ, scale: float = 0.5,
                 grad_through_norm: bool = True):
        super().__init__()
        self.inject = nn.Linear(d_in, hidden)
        self.deq = deq(NICEDEQMap(hidden, scale, grad_through_norm))
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.deq(F.softplus(self.inject(x))))


class NICE(nn.Module):
    """NICE flow with ``n_couplings`` additive couplings and a diagonal scale.

    Args:
        dim: data dimension D (even).
        n_couplings: number of couplings (4 by default; the reference code uses 2).
        m_net: ``"explicit"`` (``n_layers``-layer Softplus MLP) or ``"deq"`` (DEQ block, see :class:`DEQMNet`).
        hidden: hidden width of the m-nets.
        n_layers: Linear layers of an explicit m-net.
        deq_scale: contraction factor ``a`` of the DEQ map.
        grad_through_norm: differentiate the DEQ map's Frobenius normaliser.
        deq: the DEQ layer of each DEQ m-net, called with its fixed-point map; in a config a ``class_path:
            deqscore.deq.DEQ`` whose ``init_args`` are the solver and backward options (default: DEQ's own).
    """

    def __init__(
        self,
        dim: int = 784,  # data dimension D (even)
        n_couplings: int = 4,  # additive couplings (the reference code uses 2)
        m_net: Literal["explicit", "deq"] = "explicit",  # coupling network kind
        hidden: int = 1000,  # m-net width
        n_layers: int = 5,  # Linear layers of an explicit m-net
        deq_scale: float = 0.5,  # contraction factor a of the DEQ map
        grad_through_norm: bool = True,  # differentiate the DEQ map's Frobenius normaliser (reference: yes)
        deq: DEQFactory | None = None,  # DEQ layer options (m_net="deq"); None: DEQ's defaults
    ):
        super().__init__()
        if m_net not in M_NETS:
            raise choice_error("NICE m_net", m_net, M_NETS)
        if dim % 2 or dim < 2:
            raise ConfigError(f"NICE needs an even dimension, got {dim}")
        if n_couplings < 0:
            raise ConfigError(f"NICE needs n_couplings >= 0, got {n_couplings}")
        if not 0.0 < deq_scale < 1.0:
            raise ConfigError(f"deq_scale must lie in (0, 1) for the DEQ map to contract, got {deq_scale}")
        self.dim, self.m_net_kind = dim, m_net
        half = dim // 2
        nets = []
        for _ in range(n_couplings):
            if m_net == "explicit":
                nets.append(explicit_mlp(half, hidden, n_layers, half))
            else:
                nets.append(DEQMNet(half, hidden, half, deq or DEQ, deq_scale, grad_through_norm))
        self.m_nets = nn.ModuleList(nets)
        self.log_scale = nn.Parameter(torch.zeros(dim))

    @staticmethod
    def split_halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(even, odd) coordinates of ``[B, D]``: the two halves the couplings update in turn."""
        pairs = x.reshape(x.shape[0], -1, 2)
        return pairs[..., 0], pairs[..., 1]

    @staticmethod
    def merge_halves(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`split_halves`."""
        return torch.stack([even, odd], -1).reshape(even.shape[0], -1)

    def _couple(self, x: torch.Tensor, reverse: bool) -> torch.Tensor:
        """Apply the couplings (or undo them, in reverse order): coupling i updates the odd coordinates from
        the even ones when i is even, and the even from the odd when i is odd."""
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"NICE expects inputs of shape [B, {self.dim}], got {tuple(x.shape)}")
        even, odd = self.split_halves(x)
        order = reversed(range(len(self.m_nets))) if reverse else range(len(self.m_nets))
        sign = -1.0 if reverse else 1.0
        for i in order:
            if i % 2 == 0:
                odd = odd + sign * self.m_nets[i](even)
            else:
                even = even + sign * self.m_nets[i](odd)
        return self.merge_halves(even, odd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map data ``x`` to the latent ``y`` (standard normal under the model)."""
        return self._couple(x, reverse=False) * torch.exp(self.log_scale)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Exact inverse of :meth:`forward` (up to the DEQ solver tolerance for DEQ m-nets)."""
        return self._couple(y * torch.exp(-self.log_scale), reverse=True)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sample log-density ``[B]`` in nats (in the space of x)."""
        y = self(x)
        return -0.5 * self.dim * math.log(2 * math.pi) - 0.5 * y.pow(2).sum(1) + self.log_scale.sum()

    @torch.no_grad()
    def sample(self, n: int, temperature: float = 1.0) -> torch.Tensor:
        """Draw ``n`` samples by inverting the flow on ``temperature * N(0, I)``."""
        y = torch.randn(n, self.dim, device=self.log_scale.device, dtype=self.log_scale.dtype) * temperature
        return self.inverse(y)
