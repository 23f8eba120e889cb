"""Score-matching losses: exact SM, sliced SM (SSM, SSM-VR) and denoising SM.

Every loss takes a score function ``score_fn(x) -> s(x)`` (same shape as ``x``, differentiable in ``x`` and
the parameters) and returns the per-sample loss ``[B]``; the caller averages. Input derivatives are taken
with ``create_graph=True``, so one ordinary ``loss.backward()`` afterwards gives the parameter gradients
(this keeps DDP's gradient reduction correct). ``x`` is detached inside: these losses train the score, not
the data.

>>> import torch
>>> P = torch.eye(3) * 2.0
>>> score = lambda x: -x @ P               # Gaussian N(0, P^-1)
>>> x = torch.randn(4, 3)
>>> torch.allclose(exact_score_matching(score, x), 0.5 * ((x @ P) ** 2).sum(1) - 6.0)
True
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import check_count, check_real
from ..finite import require_finite

Tensor = torch.Tensor
ScoreFn = Callable[[Tensor], Tensor]

PROJECTIONS = ("rademacher", "gaussian", "sphere")
DSM_WEIGHTINGS = ("none", "sigma2", "sigma4")


def score_from_log_prob(log_prob_fn: Callable[[Tensor], Tensor]) -> ScoreFn:
    """Score ``s(x) = grad_x log p(x)`` of a network returning per-sample log-densities ``[B]``."""

    def score(x: Tensor) -> Tensor:
        if not x.requires_grad:
            raise ValueError("score_from_log_prob: x must require grad (the losses take care of this)")
        logp = log_prob_fn(x)
        if logp.shape != x.shape[:1]:
            raise ValueError(f"log-density must have shape [B]={tuple(x.shape[:1])}, got {tuple(logp.shape)}")
        (s,) = torch.autograd.grad(logp.sum(), x, create_graph=True, allow_unused=True)
        if s is None:
            raise ValueError("the log-density does not depend on x, so it has no score")
        return s

    return score


def score_from_energy(energy_fn: Callable[[Tensor], Tensor]) -> ScoreFn:
    """Score ``s(x) = -grad_x E(x)`` of an energy network (``log p = -E + const``)."""
    return score_from_log_prob(lambda x: -energy_fn(x))


def prepare_input(x: Tensor) -> Tensor:
    """Check ``x`` is a finite floating-point batch ``[B, ...]`` (the input checks of every loss) and return a
    detached leaf copy requiring grad."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not torch.is_floating_point(x):
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 2 or math.prod(x.shape[1:]) == 0:
        raise ValueError(
            f"x must have shape [B, ...] (a batch dimension and at least one feature), got {tuple(x.shape)}"
        )
    # one host sync, or none inside deqscore.finite.deferred_checks (the step's guard reads it)
    require_finite(x, lambda n: ValueError(f"x contains {n} non-finite values (NaN/Inf)"), what="loss input")
    return x.detach().requires_grad_(True)


def checked_score(score_fn: ScoreFn, x: Tensor, *args: object) -> Tensor:
    """Call ``score_fn(x, *args)`` and check the result has x's shape and depends on x."""
    s = score_fn(x, *args)
    if not isinstance(s, Tensor) or s.shape != x.shape:
        shape = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
        raise ValueError(f"score must have the shape of x {tuple(x.shape)}, got {shape}")
    if not s.requires_grad:
        raise ValueError("score does not depend on x (no graph): score matching needs s(x) differentiable in x")
    return s


def input_grad(out: Tensor, x: Tensor, grad_outputs: Tensor | None = None, **kw) -> Tensor:
    """``d(out)/dx`` with ``create_graph=True``; a missing dependence on x is an error, not ``None``."""
    (g,) = torch.autograd.grad(out, x, grad_outputs, create_graph=True, allow_unused=True, **kw)
    if g is None:
        raise ValueError("score does not depend on x: its input derivative is missing")
    return g


def _flat_sq(t: Tensor) -> Tensor:
    return t.flatten(1).pow(2).sum(1)


def _dot(a: Tensor, b: Tensor) -> Tensor:
    return (a * b).flatten(1).sum(1)


def random_projections(like: Tensor, kind: str = "rademacher") -> Tensor:
    """Projection vectors ``v`` with ``E[v v^T] = I`` (per sample): Rademacher, Gaussian or sphere(sqrt D)."""
    if kind == "rademacher":
        return torch.randint(0, 2, like.shape, device=like.device).to(like.dtype) * 2 - 1
    v = torch.randn_like(like)
    if kind == "gaussian":
        return v
    if kind == "sphere":
        d = like[0].numel()
        return v / v.flatten(1).norm(dim=1).view(-1, *[1] * (v.dim() - 1)) * math.sqrt(d)
    raise ValueError(f"unknown projection {kind!r}; choose one of {PROJECTIONS}")


def exact_score_matching(score_fn: ScoreFn, x: Tensor, create_graph: bool = True) -> Tensor:
    """``0.5 ||s(x)||^2 + tr(grad_x s(x))`` per sample, the trace from one batched vector-Jacobian product over the D
    unit vectors (``is_grads_batched``; memory grows like ``D * B * D``)."""
    x = prepare_input(x)
    s = checked_score(score_fn, x)
    d = x[0].numel()
    eye = torch.eye(d, dtype=x.dtype, device=x.device).view(d, 1, *x.shape[1:]).expand(d, *x.shape)
    (jac,) = torch.autograd.grad(s, x, eye, create_graph=create_graph, is_grads_batched=True, allow_unused=True)
    if jac is None:
        raise ValueError("score does not depend on x: its Jacobian is missing")
    # jac[i, b] = d s_i(x_b) / d x_b (row i of the Jacobian); the trace picks entry i of row i
    trace = jac.flatten(2).diagonal(dim1=0, dim2=2).sum(-1)
    loss = 0.5 * _flat_sq(s) + trace
    return loss if create_graph else loss.detach()


def sliced_score_matching(
    score_fn: ScoreFn,
    x: Tensor,
    n_projections: int = 1,
    projection: str = "rademacher",
    variance_reduction: bool = False,
) -> Tensor:
    """SSM ``0.5 (v.s)^2 + v.grad_x(v.s)`` or, with ``variance_reduction``, SSM-VR ``0.5||s||^2 + v.grad_x(v.s)``,
    averaged over ``n_projections`` vectors per sample (``x`` repeated, one projection per copy)."""
    check_count("n_projections", n_projections, error=ValueError)
    if projection not in PROJECTIONS:
        raise ValueError(f"unknown projection {projection!r}; choose one of {PROJECTIONS}")
    x = prepare_input(x).detach()  # checked before repeating, so an error shows the shape given
    b = x.shape[0]
    xr = x.repeat(n_projections, *[1] * (x.dim() - 1)).requires_grad_(True)
    v = random_projections(xr, projection)
    s = checked_score(score_fn, xr)
    sv = _dot(s, v)
    hvv = _dot(input_grad(sv.sum(), xr), v)
    first = 0.5 * _flat_sq(s) if variance_reduction else 0.5 * sv**2
    return (first + hvv).view(n_projections, b).mean(0)


def _per_sample(sigma: float | Tensor, x: Tensor) -> Tensor:
    """Check a float or ``[B]`` noise level (finite, positive) and broadcast it against ``x``."""
    if not isinstance(sigma, Tensor):
        check_real("DSM sigma", sigma, error=ValueError)  # a plain number: checked without a device sync
    sig = torch.as_tensor(sigma, dtype=x.dtype, device=x.device)
    if sig.dim() == 0:
        sig = sig.expand(x.shape[0])
    if sig.shape != x.shape[:1]:
        raise ValueError(f"DSM sigma must be a float or a [B] tensor, got shape {tuple(sig.shape)}")
    if isinstance(sigma, Tensor):
        positive = torch.where(sig > 0, sig, torch.nan)  # finite and positive <=> this is finite
        require_finite(positive, lambda n: ValueError(f"DSM sigma must be finite and positive, got {n} noise "
                                                      "levels that are not"), what="DSM sigma")
    return sig.view(-1, *[1] * (x.dim() - 1))


def denoising_score_matching(
    score_fn: ScoreFn, x: Tensor, sigma: float | Tensor, weighting: str = "sigma2"
) -> Tensor:
    """DSM: ``x~ = x + sigma*eps`` and the unweighted loss ``0.5 ||s(x~) + eps/sigma||^2`` times sigma^p.

    ``weighting``: ``"none"`` (p = 0), ``"sigma2"`` (p = 2, ``0.5 ||sigma*s(x~) + eps||^2``, the usual scale) or
    ``"sigma4"`` (p = 4, the paper's reference code: ``0.5 ||sigma^2 s(x~) + sigma*eps||^2``).
    """
    if weighting not in DSM_WEIGHTINGS:
        raise ValueError(f"unknown DSM weighting {weighting!r}; accepted: {DSM_WEIGHTINGS}")
    x = prepare_input(x).detach()
    sig = _per_sample(sigma, x)
    eps = torch.randn_like(x)
    xt = (x + sig * eps).requires_grad_(True)
    s = checked_score(score_fn, xt)
    sigma2_weighted = 0.5 * _flat_sq(sig * s + eps)  # computed in this form: no division by a small sigma
    return sigma2_weighted * sig.flatten() ** (DSM_WEIGHTINGS.index(weighting) * 2 - 2)
