"""Small contractive maps shared by the DEQ tests."""

import torch
from torch import nn


class TanhMap(nn.Module):
    """``f(z, u) = tanh(W z + u)`` with ``||W||_2 = rho``: a contraction with factor at most rho."""

    def __init__(self, dim: int, rho: float = 0.5):
        super().__init__()
        w = torch.randn(dim, dim, dtype=torch.float64)
        self.weight = nn.Parameter(w / torch.linalg.matrix_norm(w, ord=2) * rho)

    def forward(self, z, u):
        return torch.tanh(z @ self.weight.T + u)


class LinearMap(nn.Module):
    """``f(z, u) = A z + u`` (the Neumann series of its Jacobian is known in closed form)."""

    def __init__(self, dim: int, rho: float = 0.6):
        super().__init__()
        a = torch.randn(dim, dim, dtype=torch.float64)
        self.weight = nn.Parameter(a / torch.linalg.matrix_norm(a, ord=2) * rho)

    def forward(self, z, u):
        return z @ self.weight.T + u


def loss_gradients(build, deq, state=None):
    """A family probe's module built with ``deq`` (weights ``state`` if given) and its loss's parameter gradients,
    by name; the seeds make the weights and the loss's own draws the same for every ``deq`` compared."""
    torch.manual_seed(0)
    module, loss = build(deq)
    if state is not None:
        module.load_state_dict(state)
    torch.manual_seed(3)  # the loss's own draws (projections, noise levels, encoder noise): the same for both
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(loss().mean(), list(params.values()), allow_unused=True)
    return module, dict(zip(params, grads, strict=True))
