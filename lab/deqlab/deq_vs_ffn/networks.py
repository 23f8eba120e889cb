"""The study's tasks (steep along one coordinate, with exact samples and targets) and its networks under one
weight-norm budget: a DEQ on deqscore's layer and constant-depth tanh networks with its parameter count."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from deqscore.deq import DEQ, spectral_cap
from deqscore.losses import sliced_score_matching
from deqscore.metrics import parameter_count

Tensor = torch.Tensor


def slope(dim: int, protocol: dict) -> float:
    """``a_d``: the steepness of both tasks along ``x_1`` at dimension ``d``."""
    c = protocol["construction"]
    return c["slope_base"] ** (dim / c["slope_dims_per_doubling"])


@dataclass(frozen=True)
class Task:
    """A steep task in ``dim`` dimensions: exact samples, the metric, the training loss."""

    kind: str  # "regression" or "score"
    dim: int
    a: float  # the slope along x_1

    @property
    def k(self) -> float:
        """The score task's sigmoid steepness: the exact score's x_1 part has slope ``1 + k^2 / 4 = 1 + a``."""
        return 2.0 * math.sqrt(self.a)

    @property
    def out_dim(self) -> int:
        return 1 if self.kind == "regression" else self.dim

    def sample(self, n: int, gen: torch.Generator) -> Tensor:
        if self.kind == "regression":
            return torch.randn(n, self.dim, generator=gen)
        out, have = [], 0  # N(0, I) proposals accepted with probability sigmoid(k x_1) (rate 1/2)
        while have < n:
            x = torch.randn(3 * n, self.dim, generator=gen)
            keep = torch.rand(3 * n, generator=gen) < torch.sigmoid(self.k * x[:, 0])
            out.append(x[keep])
            have += int(keep.sum())
        return torch.cat(out)[:n]

    def target(self, x: Tensor) -> Tensor:
        """The regression target ``tanh(a x_1)``, or the exact score ``-x + e_1 k sigmoid(-k x_1)``."""
        if self.kind == "regression":
            return torch.tanh(self.a * x[:, :1])
        s = -x.clone()
        s[:, 0] += self.k * torch.sigmoid(-self.k * x[:, 0])
        return s

    def loss(self, net: nn.Module, x: Tensor) -> Tensor:
        if self.kind == "regression":
            return (net(x) - self.target(x)).pow(2).mean()
        return sliced_score_matching(net, x, variance_reduction=True).mean()

    def control(self, x: Tensor) -> float:
        """The metric of the trivial answer: 0 for the regression, the Gaussian score ``-x`` for the score."""
        return self.metric(lambda x: torch.zeros(len(x), 1) if self.kind == "regression" else -x, x)

    def metric(self, net: Callable[[Tensor], Tensor], x: Tensor) -> float:
        """Held-out RMSE (regression) or Fisher divergence ``E ||s - grad log p||^2`` (score)."""
        with torch.no_grad():
            err = (net(x) - self.target(x)).pow(2).sum(1).mean()
        return float(err.sqrt() if self.kind == "regression" else err)


def capped(lin: nn.Linear, bound: float) -> nn.Linear:
    return spectral_cap(lin, bound)


class TanhMap(nn.Module):
    """``f(z, u) = tanh(W z + u)`` with ``||W||_2 <= gamma``: a gamma-contraction in ``z``."""

    def __init__(self, width: int, gamma: float):
        super().__init__()
        self.lin = capped(nn.Linear(width, width, bias=False), gamma)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return torch.tanh(self.lin(z) + u)


class DEQNet(nn.Module):
    """``y = V z* + c``, ``z* = tanh(W z* + U x + b)``; ``||U||, ||V|| <= B``, ``||W|| <= gamma``."""

    def __init__(self, dim: int, out_dim: int, width: int, bound: float, gamma: float, deq: dict):
        super().__init__()
        self.inp = capped(nn.Linear(dim, width), bound)
        self.deq = DEQ(TanhMap(width, gamma), warn_on_nonconvergence=False, **deq)
        self.out = capped(nn.Linear(width, out_dim), bound)
        self.lipschitz_cap = bound**2 / (1.0 - gamma)

    def forward(self, x: Tensor) -> Tensor:
        # One singular value decomposition per weight per forward, not per solver iteration. The cache is filled
        # here, with autograd on: filled inside the solve's no_grad, the phantom steps would reuse a weight that
        # carries no gradient and W would never train.
        with parametrize.cached():
            _ = self.deq.func.lin.weight
            return self.out(self.deq(self.inp(x)))


class FFN(nn.Module):
    """``depth`` tanh hidden layers of ``width``; every matrix's spectral norm at most ``B``."""

    def __init__(self, dim: int, out_dim: int, width: int, depth: int, bound: float):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [capped(nn.Linear(dim if i == 0 else width, width), bound), nn.Tanh()]
        self.body = nn.Sequential(*layers, capped(nn.Linear(width, out_dim), bound))
        self.lipschitz_cap = bound ** (depth + 1)

    def forward(self, x: Tensor) -> Tensor:
        with parametrize.cached():
            return self.body(x)


def ffn_parameters(dim: int, out_dim: int, width: int, depth: int) -> int:
    """Parameters of :class:`FFN`."""
    return dim * width + width + (depth - 1) * (width * width + width) + width * out_dim + out_dim


def matched_width(dim: int, out_dim: int, depth: int, target: int) -> int:
    """The FFN width whose parameter count is closest to ``target``.

    >>> matched_width(2, 1, 2, ffn_parameters(2, 1, 40, 2))
    40
    """
    return min(range(1, 4 * int(math.sqrt(target)) + 8),
               key=lambda w: abs(ffn_parameters(dim, out_dim, w, depth) - target))


def build(network: str, task: Task, protocol: dict) -> nn.Module:
    """``"deq"`` or ``"ffn<depth>"`` (the latter matched to the DEQ's parameter count)."""
    budget, width = protocol["budget"], protocol["networks"]["deq_width"]
    bound, gamma = budget["weight_spectral_bound"], budget["deq_contraction_bound"]
    deq = DEQNet(task.dim, task.out_dim, width, bound, gamma, protocol["deq"])
    if network == "deq":
        return deq
    depth = int(network[3:])
    width = matched_width(task.dim, task.out_dim, depth, parameter_count(deq))
    return FFN(task.dim, task.out_dim, width, depth, bound)


def weight_norms(net: nn.Module) -> dict[str, float]:
    """The largest spectral norm and the largest entry over the (capped) weight matrices."""
    weights = [m.weight.detach() for m in net.modules() if isinstance(m, nn.Linear)]
    return {"max_spectral_norm": max(float(torch.linalg.matrix_norm(w, ord=2)) for w in weights),
            "max_abs_weight": max(float(w.abs().max()) for w in weights)}


def largest_slope(net: nn.Module, x: Tensor) -> float:
    """``max |d y_1 / d x_1|`` over the samples (``y_1``: the output, or the score's x_1 part)."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(net(x)[:, 0].sum(), x)
    return float(g[:, 0].abs().max())


