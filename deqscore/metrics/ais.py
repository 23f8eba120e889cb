"""Annealed importance sampling (AIS) with Hamiltonian Monte Carlo moves: a stochastic lower bound on ``log p(x)``
of a latent-variable model (docs/method.md section 4.3, evaluation).

For each ``x`` and each of ``n_chains`` chains, ``z`` starts from the prior ``N(0, I)`` and moves through the
intermediate targets ``pi_t(z) ∝ N(z; 0, I) p(x | z)^beta_t``, ``0 = beta_0 < ... < beta_T = 1`` on a sigmoid schedule,
by one HMC step each (``leapfrog`` leapfrog steps of a step size per x, adapted towards an acceptance rate of
0.65 over its chains). The log weight collects ``(beta_t - beta_{t-1}) log p(x | z_{t-1})``, and
``log p(x) ~ logmeanexp_chains(log w)``, whose expectation is a lower bound (Jensen) that tightens with T.

>>> import torch
>>> loglik = lambda x, z: -0.5 * ((x - z) ** 2).sum(1) - 0.5 * x.shape[1] * math.log(2 * math.pi)
>>> est = ais_log_likelihood(loglik, torch.zeros(2, 1), z_dim=1, n_steps=500, n_chains=32, step_size=0.5,
...                          generator=torch.Generator().manual_seed(0), progress=False)
>>> bool(((est - (-0.5 * math.log(2 * math.pi * 2))).abs() < 0.05).all())   # x ~ N(0, 2): log p(0)
True
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..errors import check_count, check_real

Tensor = torch.Tensor
LogLikelihood = Callable[[Tensor, Tensor], Tensor]  # (x [N, ...], z [N, k]) -> log p(x | z) [N]
TARGET_ACCEPTANCE = 0.65


def sigmoid_schedule(n_steps: int, rad: float = 4.0) -> Tensor:
    """``beta_0 = 0 < ... < beta_T = 1``: a sigmoid of ``linspace(-rad, rad)``, rescaled to [0, 1] (dense at both
    ends, where the targets change fastest)."""
    s = torch.sigmoid(torch.linspace(-rad, rad, n_steps + 1, dtype=torch.float64))
    return (s - s[0]) / (s[-1] - s[0])


def _log_lik_and_grad(log_lik: LogLikelihood, x: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """``log p(x|z)`` and its gradient in z, per chain. The log target at any beta follows from the two without
    another pass: ``log N(z) + beta log p(x|z)``, gradient ``-z + beta grad``."""
    with torch.enable_grad():
        z = z.detach().requires_grad_(True)
        value = log_lik(x, z)
        (grad,) = torch.autograd.grad(value.sum(), z)
    return value.detach(), grad


def _target(z: Tensor, beta: float, lik: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    return -0.5 * z.pow(2).sum(1) + beta * lik, -z + beta * grad


def _hmc(log_lik: LogLikelihood, x: Tensor, z: Tensor, lik: tuple[Tensor, Tensor], beta: float, step: Tensor,
         leapfrog: int, gen: torch.Generator | None) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor]:
    """One HMC move per chain (step sizes ``step`` [N]) from ``z``, whose ``log p(x|z)`` and gradient are ``lik``;
    returns the new z with its ``lik`` and the acceptance mask. Every evaluation of the likelihood is a leapfrog
    step's: the start's comes from the previous move."""
    eps = step[:, None]
    p0 = torch.randn(z.shape, generator=gen, device=z.device, dtype=z.dtype)
    value0, grad = _target(z, beta, *lik)
    z_new, p = z, p0 + 0.5 * eps * grad
    for i in range(leapfrog):
        z_new = z_new + eps * p
        lik_new = _log_lik_and_grad(log_lik, x, z_new)
        value, grad = _target(z_new, beta, *lik_new)
        p = p + (eps if i < leapfrog - 1 else 0.5 * eps) * grad
    log_accept = (value - 0.5 * p.pow(2).sum(1)) - (value0 - 0.5 * p0.pow(2).sum(1))
    u = torch.rand(log_accept.shape, generator=gen, device=z.device, dtype=z.dtype)
    accept = torch.isfinite(log_accept) & (u.log() < log_accept)
    kept = tuple(torch.where(accept.view(-1, *[1] * (new.dim() - 1)), new, old)
                 for new, old in zip(lik_new, lik, strict=True))
    return torch.where(accept[:, None], z_new, z), kept, accept


@torch.no_grad()
def ais_log_likelihood(
    log_lik: LogLikelihood,
    x: Tensor,
    z_dim: int,
    n_steps: int = 1000,  # intermediate distributions T
    n_chains: int = 16,  # independent chains per x
    leapfrog: int = 10,  # leapfrog steps per HMC move
    step_size: float = 0.01,  # initial HMC step size (adapted per chain)
    generator: torch.Generator | None = None,
    progress: bool = True,
) -> Tensor:
    """AIS estimate of ``log p(x)`` per row of ``x`` (float64 ``[B]``); see the module docstring."""
    check_count("AIS z_dim", z_dim, error=ValueError)
    check_count("AIS n_steps", n_steps, error=ValueError)
    check_count("AIS n_chains", n_chains, error=ValueError)
    check_count("AIS leapfrog", leapfrog, error=ValueError)
    check_real("AIS step_size", step_size, error=ValueError)
    b = x.shape[0]
    xr = x.repeat_interleave(n_chains, 0)  # chains of one x are adjacent
    z = torch.randn(b * n_chains, z_dim, generator=generator, device=x.device, dtype=x.dtype)
    step = torch.full((b * n_chains,), step_size, device=x.device, dtype=x.dtype)
    betas = sigmoid_schedule(n_steps).tolist()
    log_w = torch.zeros(b * n_chains, dtype=torch.float64, device=x.device)
    lik = _log_lik_and_grad(log_lik, xr, z)
    for t in tqdm(range(1, n_steps + 1), desc="AIS", unit="step", disable=not progress, leave=False):
        log_w += (betas[t] - betas[t - 1]) * lik[0].double()
        z, lik, accept = _hmc(log_lik, xr, z, lik, betas[t], step, leapfrog, generator)
        # one step size per x, from the acceptance rate of all its chains (a chain adapting to its own
        # acceptances would bias its weights)
        rate = accept.to(step.dtype).view(b, n_chains).mean(1).repeat_interleave(n_chains)
        step = step * torch.exp(0.02 * (rate - TARGET_ACCEPTANCE))  # steady at that acceptance
    log_w = log_w.view(b, n_chains)
    return torch.logsumexp(log_w, 1) - math.log(n_chains)
