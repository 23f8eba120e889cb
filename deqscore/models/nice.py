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
import numbers
from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..deq import DEQ, DEQFactory
from ..errors import ConfigError, check_count, check_real, choice_error
from ..finite import require_finite

M_NETS = ("explicit", "deq")


def explicit_mlp(d_in: int, hidden: int, n_layers: int, d_out: int) -> nn.Sequential:
    """``n_layers`` Linear layers, Softplus between: ``d_in -> hidden x (n_layers-1) -> d_out``."""
    check_count("n_layers", n_layers, low=2, why=" (an explicit m-net has n_layers Linear layers)")
    check_count("hidden", hidden)
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

    additive_injection = True  # f(z, u) = h(z) + u: the implicit backward saves no copy of u

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


def _check_options(dim: int, n_couplings: int, m_net: str, hidden: int, deq_scale: float) -> None:
    """Raise :class:`ConfigError` naming the first NICE option out of range (n_layers: :func:`explicit_mlp`)."""
    if m_net not in M_NETS:
        raise choice_error("NICE m_net", m_net, M_NETS)
    check_count("NICE dim", dim, low=2)
    if dim % 2:
        raise ConfigError(f"NICE dim must be even (two halves of D/2 coordinates), got {dim}")
    check_count("NICE n_couplings", n_couplings, why=": without couplings NICE is only a diagonal Gaussian")
    check_count("NICE hidden", hidden)
    check_real("NICE deq_scale", deq_scale, high=1.0, high_closed=False)


class NICE(nn.Module):
    """NICE flow with ``n_couplings`` additive couplings and a diagonal scale.

    Args:
        dim: data dimension D (even).
        n_couplings: number of couplings, >= 1 (4 by default; the reference code uses 2).
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
        n_couplings: int = 4,  # additive couplings, >= 1 (the reference code uses 2)
        m_net: Literal["explicit", "deq"] = "explicit",  # coupling network kind
        hidden: int = 1000,  # m-net width
        n_layers: int = 5,  # Linear layers of an explicit m-net
        deq_scale: float = 0.5,  # contraction factor a of the DEQ map
        grad_through_norm: bool = True,  # differentiate the DEQ map's Frobenius normaliser (reference: yes)
        deq: DEQFactory | None = None,  # DEQ layer options (m_net="deq"); None: DEQ's defaults
    ):
        super().__init__()
        _check_options(dim, n_couplings, m_net, hidden, deq_scale)
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
        pairs = rearrange(x, "b (d two) -> b d two", two=2)
        return pairs[..., 0], pairs[..., 1]

    @staticmethod
    def merge_halves(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`split_halves`."""
        return rearrange(torch.stack([even, odd], -1), "b d two -> b (d two)")

    def _check_input(self, x: torch.Tensor) -> None:
        """Shape ``[B, D]`` and finite values, checked once per public call (not per coupling: on a GPU the
        finiteness test is a host sync)."""
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"NICE expects inputs of shape [B, {self.dim}], got {tuple(x.shape)}")
        # inside deqscore.finite.deferred_checks (a sync-free training step) the check joins the step's one flag
        require_finite(x, lambda n: ValueError(f"the input to NICE contains {n} non-finite values (NaN/Inf)"),
                       what="NICE input")

    def _couple(self, x: torch.Tensor, reverse: bool) -> torch.Tensor:
        """Apply the couplings (or undo them, in reverse order): coupling i updates the odd coordinates from
        the even ones when i is even, and the even from the odd when i is odd."""
        even, odd = self.split_halves(x)
        order = reversed(range(len(self.m_nets))) if reverse else range(len(self.m_nets))
        sign = -1.0 if reverse else 1.0
        for i in order:
            if i % 2 == 0:
                odd = odd + sign * self.m_nets[i](even)
            else:
                even = even + sign * self.m_nets[i](odd)
        return self.merge_halves(even, odd)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._couple(x, reverse=False) * torch.exp(self.log_scale)

    def _inverse(self, y: torch.Tensor) -> torch.Tensor:
        return self._couple(y * torch.exp(-self.log_scale), reverse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map data ``x`` to the latent ``y`` (standard normal under the model)."""
        self._check_input(x)
        return self._forward(x)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Exact inverse of :meth:`forward` (up to the DEQ solver tolerance for DEQ m-nets)."""
        self._check_input(y)
        return self._inverse(y)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sample log-density ``[B]`` in nats (in the space of x)."""
        self._check_input(x)
        y = self._forward(x)
        return -0.5 * self.dim * math.log(2 * math.pi) - 0.5 * y.pow(2).sum(1) + self.log_scale.sum()

    @torch.no_grad()
    def sample(self, n: int, temperature: float = 1.0) -> torch.Tensor:
        """Draw ``n`` samples by inverting the flow on ``temperature * N(0, I)``."""
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature):
            raise ValueError(f"NICE.sample: temperature must be a finite number, got {temperature!r}")
        y = torch.randn(n, self.dim, device=self.log_scale.device, dtype=self.log_scale.dtype) * temperature
        return self._inverse(y)  # finite by construction: no input check (and no device sync)
