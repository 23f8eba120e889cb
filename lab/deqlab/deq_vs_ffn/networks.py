"""The study's tasks (steep along one coordinate, with exact samples and targets), its networks (a DEQ on deqscore's
layer, tanh networks matched to its parameter count or its FLOPs) under one Lipschitz budget per comparison, and the
budget's provable floor."""

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
        self.layer_cap, self.gamma = bound, gamma
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
        self.layer_cap, self.lipschitz_cap = bound, bound ** (depth + 1)

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


FLOP_MATCHED_DEPTH = 54  # the protocol's ffn54: width 48 like the DEQ, one layer per DEQ iteration or phantom step


@dataclass(frozen=True)
class Budget:
    """One comparison's Lipschitz budget: the DEQ's ``B``, ``gamma``, phantom steps and iteration cap, and the
    bound ``lipschitz = B^2 / (1 - gamma)`` that every network of the comparison shares."""

    bound: float
    gamma: float
    phantom_steps: int
    max_iter: int

    @property
    def lipschitz(self) -> float:
        return self.bound**2 / (1.0 - self.gamma)

    def layer_cap(self, depth: int) -> float:
        """The per-matrix cap of a feed-forward network of ``depth`` hidden layers: its ``depth + 1`` caps multiply
        to the budget."""
        return self.lipschitz ** (1.0 / (depth + 1))


def budget(kind: str, a: float, protocol: dict) -> Budget:
    """The protocol's ``"control"`` budget (gamma fixed) or its ``"steep"`` one at slope ``a``:
    ``gamma = max(gamma_0, 1 - B^2 / (2 a))``, phantom steps ``ceil(40 ln 0.9 / ln gamma)`` (``gamma^K`` no larger
    than the control's) and ``max_iter = ceil(200 (1 - 0.9) / (1 - gamma))``.

    >>> p = {"budget": {"deq_weight_bound": 2.0, "control_gamma": 0.9}}
    >>> b = budget("steep", 256.0, p); b.gamma, b.lipschitz, b.phantom_steps, b.max_iter
    (0.9921875, 512.0, 538, 2560)
    >>> budget("steep", 16.0, p) == budget("control", 256.0, p)
    True
    """
    spec = protocol["budget"]
    bound, gamma0 = spec["deq_weight_bound"], spec["control_gamma"]
    gamma = gamma0 if kind == "control" else max(gamma0, 1.0 - bound**2 / (2.0 * a))
    steps = math.ceil(40 * math.log(gamma0) / math.log(gamma) - 1e-9)
    max_iter = math.ceil(200 * (1 - gamma0) / (1 - gamma) - 1e-9)
    return Budget(bound, gamma, steps, max_iter)


def build(network: str, task: Task, spend: Budget, protocol: dict) -> nn.Module:
    """``"deq"``/``"deq_steep"`` (the DEQ under ``spend``), ``"ffn54"`` (width of the DEQ, 54 layers: matched in FLOPs)
    or ``"ffn<depth>"`` (matched to the DEQ's parameter count), every network's bound ``spend.lipschitz``."""
    width = protocol["networks"]["deq_width"]
    deq_opts = {**protocol["deq"], "phantom_steps": spend.phantom_steps, "max_iter": spend.max_iter}
    deq = DEQNet(task.dim, task.out_dim, width, spend.bound, spend.gamma, deq_opts)
    if network.startswith("deq"):
        return deq
    depth = int(network[3:])
    if depth != FLOP_MATCHED_DEPTH:
        width = matched_width(task.dim, task.out_dim, depth, parameter_count(deq))
    return FFN(task.dim, task.out_dim, width, depth, spend.layer_cap(depth))


def clipped_fit_floor(a: float, lipschitz: float, points: int = 200_001) -> float:
    """The least RMSE of a ``lipschitz``-Lipschitz function of ``x ~ N(0, I)`` against ``tanh(a x_1)``: that of
    ``sign(x_1) min(L |x_1|, tanh(a |x_1|))`` (Simpson's rule on |x_1| in [0, 12]; 0 when ``L >= a``)."""
    if lipschitz >= a:
        return 0.0
    x = torch.linspace(0.0, 12.0, points, dtype=torch.float64)
    target = torch.tanh(a * x)
    gap = (target - torch.minimum(lipschitz * x, target)).pow(2) * torch.exp(-x * x / 2) * math.sqrt(2 / math.pi)
    weights = torch.ones(points, dtype=torch.float64)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    return math.sqrt(float((gap * weights).sum() * (x[1] - x[0]) / 3))


def weight_norms(net: nn.Module) -> dict[str, float]:
    """The largest spectral norm and the largest entry over the (capped) weight matrices, and the product of the
    spectral norms (the trained network's Lipschitz bound, the DEQ's as ``||U|| ||V|| / (1 - ||W||)``)."""
    norms = {name: float(torch.linalg.matrix_norm(m.weight.detach(), ord=2))
             for name, m in net.named_modules() if isinstance(m, nn.Linear)}
    if isinstance(net, DEQNet):
        recurrent = norms.pop("deq.func.lin")
        product = math.prod(norms.values()) / (1.0 - recurrent)
    else:
        recurrent, product = None, math.prod(norms.values())
    weights = [m.weight.detach() for m in net.modules() if isinstance(m, nn.Linear)]
    return {"max_spectral_norm": max([*norms.values(), recurrent or 0.0]), "recurrent_norm": recurrent,
            "spectral_product": product, "max_abs_weight": max(float(w.abs().max()) for w in weights)}


def largest_slope(net: nn.Module, x: Tensor) -> float:
    """``max |d y_1 / d x_1|`` over the samples (``y_1``: the output, or the score's x_1 part)."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(net(x)[:, 0].sum(), x)
    return float(g[:, 0].abs().max())


