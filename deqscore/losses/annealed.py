"""Annealed losses for noise-conditional score networks ``score_fn(x, sigma) -> s`` (sigma of shape ``[B]``).

Each sample draws a noise level ``sigma_i`` from ``sigmas`` (or takes ``labels``), is perturbed to
``x~ = x + sigma_i * eps`` and the loss is weighted by ``sigma_i^2`` (NCSN's weighting):

* :func:`annealed_dsm`: ``0.5 ||s(x~, sigma) + eps/sigma||^2 * sigma^2``;
* :func:`annealed_ssm_vr`: ``(0.5 ||s||^2 + v.grad(v.s)) * sigma^2`` with Gaussian v;
* :func:`annealed_fd_ssm`: the finite-difference SSM of Pang et al. (2020), forward evaluations only.

>>> import torch
>>> sigmas = geometric_sigmas(1.0, 0.01, 10)
>>> loss = annealed_dsm(lambda x, s: -x / (1 + s[:, None] ** 2), torch.randn(8, 2), sigmas)
>>> loss.shape
torch.Size([8])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import ConfigError, check_count, check_real, choice_error
from ..finite import require_finite
from .score_matching import _dot, _flat_sq, checked_score, input_grad, prepare_input

Tensor = torch.Tensor
CondScoreFn = Callable[[Tensor, Tensor], Tensor]


def geometric_sigmas(sigma_max: float, sigma_min: float, n_levels: int) -> Tensor:
    """``exp(linspace(log sigma_max, log sigma_min, L))``: the NCSN noise schedule, largest first."""
    return torch.exp(torch.linspace(math.log(sigma_max), math.log(sigma_min), n_levels, dtype=torch.float64))


def linear_sigmas(sigma_max: float, sigma_min: float, n_levels: int) -> Tensor:
    """``linspace(sigma_max, sigma_min, L)``: evenly spaced noise levels, largest first."""
    return torch.linspace(sigma_max, sigma_min, n_levels, dtype=torch.float64)


#: noise schedules by name: ``(sigma_max, sigma_min, n_levels) -> sigmas``, largest first
SCHEDULES: dict[str, Callable[[float, float, int], Tensor]] = {"geometric": geometric_sigmas, "linear": linear_sigmas}


def max_pairwise_distance(x: Tensor, chunk: int = 1024) -> float:
    """The largest Euclidean distance between two rows of ``x`` ``[N, D]`` (float64, in chunks of rows)."""
    x = x.reshape(len(x), -1).double()
    return max(float(torch.cdist(part, x).max()) for part in x.split(chunk))


def geometric_ratio(dim: int, tol: float = 1e-10) -> float:
    """The ratio gamma > 1 of consecutive noise levels with
    ``Phi(sqrt(2D)(gamma - 1) + 3 gamma) - Phi(sqrt(2D)(gamma - 1) - 3 gamma) = 1/2`` (Song and Ermon 2020,
    technique 2: a perturbed sample of one level lies, with probability 1/2, in the high-density shell of the next).

    >>> round(geometric_ratio(3 * 32 * 32), 4)  # CIFAR-10 (NCSNv2's config: (50 / 0.01)^(1/231) = 1.0376)
    1.0398
    """
    root = math.sqrt(2 * dim)
    if root <= 3:  # the overlap then grows towards 1 with gamma: no ratio halves it
        raise ConfigError(f"a noise schedule from the data needs data of dimension >= 5, got {dim}")

    def overlap(gamma: float) -> float:
        phi = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
        return phi(root * (gamma - 1) + 3 * gamma) - phi(root * (gamma - 1) - 3 * gamma)

    low, high = 1.0, 2.0
    while overlap(high) > 0.5:  # small D: the ratio may exceed 2
        high *= 2
    while high - low > tol:  # overlap decreases in gamma
        mid = (low + high) / 2
        low, high = (mid, high) if overlap(mid) > 0.5 else (low, mid)
    return (low + high) / 2


def langevin_step_size(sigma_min: float, gamma: float, n_steps_each: int) -> float:
    """The step size eps of annealed Langevin dynamics (steps ``eps sigma_i^2 / sigma_L^2``) for which
    ``(1 - eps/s2)^(2T) (gamma^2 - 2 eps / (s2 - s2 (1 - eps/s2)^2)) + 2 eps / (s2 - s2 (1 - eps/s2)^2)`` is
    closest to 1, with ``s2 = sigma_L^2`` and T steps per level (Song and Ermon 2020, technique 4: after T steps
    at one level, the samples' variance matches that level).

    >>> f"{langevin_step_size(0.01, (50 / 0.01) ** (1 / 231), 5):.2e}"  # NCSNv2's CIFAR-10 config: 6.2e-6
    '6.18e-06'
    """
    s2 = sigma_min**2

    def gap(eps: float) -> float:
        keep = (1 - eps / s2) ** 2
        drift = 2 * eps / (s2 - s2 * keep)
        return abs(keep**n_steps_each * (gamma**2 - drift) + drift - 1)

    grid = torch.logspace(math.log10(s2) - 12, math.log10(s2), 20001, dtype=torch.float64).tolist()[:-1]
    return min(grid, key=gap)


def schedule_from_data(x: Tensor, sigma_min: float, n_steps_each: int) -> dict[str, float | int]:
    """NCSNv2's schedule for training data ``x`` ``[N, D]`` in model space: ``sigma_max`` the largest pairwise
    distance (technique 1), ``n_levels`` from the ratio of :func:`geometric_ratio` (technique 2), and the
    Langevin ``step_lr`` of :func:`langevin_step_size` (technique 4).

    >>> x = torch.zeros(3, 8)
    >>> x[1, :2] = torch.tensor([3.0, 4.0])
    >>> schedule_from_data(x, 0.01, 5)["sigma_max"]
    5.0
    """
    check_real("sigma_min", sigma_min)
    check_count("n_steps_each", n_steps_each)
    sigma_max = max_pairwise_distance(x)
    if not sigma_max > sigma_min:
        raise ConfigError(f"the training data's largest pairwise distance {sigma_max:g} does not exceed sigma_min="
                          f"{sigma_min}: a schedule from the data needs distinct points", key="sigma_min")
    gamma = geometric_ratio(x[0].numel())
    n_levels = max(2, math.ceil(math.log(sigma_max / sigma_min) / math.log(gamma)) + 1)
    return {"sigma_max": sigma_max, "n_levels": n_levels, "gamma": gamma,
            "step_lr": langevin_step_size(sigma_min, gamma, n_steps_each)}


def noise_schedule(kind: str, sigma_max: float, sigma_min: float, n_levels: int) -> Tensor:
    """The ``kind`` schedule (float64, strictly decreasing), or a :class:`~deqscore.errors.ConfigError` naming the
    option that is wrong (an unknown name, a non-positive level, ``sigma_max <= sigma_min``, ``n_levels < 2``).

    >>> [round(s, 12) for s in noise_schedule("geometric", 1.0, 0.01, 3).tolist()]
    [1.0, 0.1, 0.01]
    """
    if kind not in SCHEDULES:
        raise choice_error("noise schedule", kind, SCHEDULES)
    check_real("sigma_max", sigma_max)
    check_real("sigma_min", sigma_min)
    check_count("n_levels", n_levels, low=2, why=" (an annealed schedule has at least two noise levels)")
    if not sigma_max > sigma_min:
        raise ConfigError(f"the noise schedule must decrease: sigma_max={sigma_max} must exceed sigma_min={sigma_min}",
                          key="sigma_max")
    return SCHEDULES[kind](sigma_max, sigma_min, n_levels)


def check_decreasing(sigmas: Tensor) -> Tensor:
    """``sigmas`` checked to be finite, positive and strictly decreasing (the order samplers anneal in)."""
    sigmas = _checked_sigmas(sigmas)
    if len(sigmas) > 1 and not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError(f"sigmas must be strictly decreasing (largest first), got {sigmas.tolist()}")
    return sigmas


def _checked_sigmas(sigmas: Tensor) -> Tensor:
    """``sigmas`` as a tensor, checked to be a non-empty 1-D list of finite positive noise levels (on the device
    it was given on: the usual CPU schedule costs no device sync)."""
    sigmas = torch.as_tensor(sigmas)
    if sigmas.dim() != 1 or len(sigmas) == 0:
        raise ValueError(f"sigmas must be a non-empty 1-D tensor of noise levels, got shape {tuple(sigmas.shape)}")
    positive = torch.where(sigmas > 0, sigmas, torch.nan)  # finite and positive <=> this is finite
    # a module's schedule lives on its device: inside deqscore.finite.deferred_checks this is no host sync
    require_finite(positive, lambda n: ValueError(f"sigmas must be finite and positive, got {n} noise levels "
                                                  "that are not"), what="noise levels")
    return sigmas


def _noise(x: Tensor, sigmas: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Checked input, per-sample sigma ``[B]`` and its broadcastable view."""
    x = prepare_input(x).detach()
    sigmas = _checked_sigmas(sigmas).to(dtype=x.dtype, device=x.device)
    if labels is None:
        labels = torch.randint(0, len(sigmas), (x.shape[0],), device=x.device)
    if labels.shape != x.shape[:1]:
        raise ValueError(f"labels must have shape [B]={tuple(x.shape[:1])}, got {tuple(labels.shape)}")
    sigma = sigmas[labels]
    return x, sigma, sigma.view(-1, *[1] * (x.dim() - 1))


def annealed_dsm(score_fn: CondScoreFn, x: Tensor, sigmas: Tensor, labels: Tensor | None = None) -> Tensor:
    """Annealed denoising score matching, per sample."""
    x, sigma, sig = _noise(x, sigmas, labels)
    eps = torch.randn_like(x)
    xt = (x + sig * eps).requires_grad_(True)
    s = checked_score(score_fn, xt, sigma)
    return 0.5 * _flat_sq(s + eps / sig) * sigma**2


def dsm_every_level(score_fn: CondScoreFn, x: Tensor, sigmas: Tensor, generator: torch.Generator) -> Tensor:
    """The denoising loss of every sample at every noise level, ``[B, L]``, in the training weighting:
    ``0.5 ||sigma s(x + sigma eps, sigma) + eps||^2`` with ``eps`` drawn from ``generator`` (on the CPU, so that a
    seed gives the same noise on every device): a held-out figure with no randomness but the seed's."""
    x = prepare_input(x).detach()
    sigmas = _checked_sigmas(sigmas).to(dtype=x.dtype, device=x.device)
    losses = []
    for sigma in sigmas:
        eps = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
        s = score_fn(x + sigma * eps, sigma.expand(x.shape[0]))
        losses.append(0.5 * _flat_sq(sigma * s + eps))
    return torch.stack(losses, dim=1)


def annealed_ssm_vr(
    score_fn: CondScoreFn, x: Tensor, sigmas: Tensor, labels: Tensor | None = None, n_projections: int = 1
) -> Tensor:
    """Annealed sliced score matching with variance reduction (Gaussian projections), per sample."""
    check_count("n_projections", n_projections, error=ValueError)
    x, sigma, sig = _noise(x, sigmas, labels)
    xt = (x + sig * torch.randn_like(x)).repeat(n_projections, *[1] * (x.dim() - 1)).requires_grad_(True)
    sigma_r = sigma.repeat(n_projections)
    v = torch.randn_like(xt)
    s = checked_score(score_fn, xt, sigma_r)
    hvv = _dot(input_grad(_dot(s, v).sum(), xt), v)
    loss = (0.5 * _flat_sq(s) + hvv) * sigma_r**2
    return loss.view(n_projections, x.shape[0]).mean(0)


def annealed_fd_ssm(
    score_fn: CondScoreFn, x: Tensor, sigmas: Tensor, labels: Tensor | None = None, fd_eps: float = 0.1
) -> Tensor:
    """Finite-difference SSM-VR: ``[||s+ + s-||^2/8 + ((s+ - s-).v) D/(2 eps^2)] * sigma^2``, ``||v|| = eps``.

    ``s± = s(x~ ± v, sigma)``; only forward evaluations of the network (first-order through a DEQ).
    """
    check_real("fd_eps", fd_eps, error=ValueError)
    x, sigma, sig = _noise(x, sigmas, labels)
    xt = x + sig * torch.randn_like(x)
    d = x[0].numel()
    v = torch.randn_like(xt)
    v = v / v.flatten(1).norm(dim=1).view_as(sigma).view(-1, *[1] * (x.dim() - 1)) * fd_eps
    both = torch.cat([xt + v, xt - v]).requires_grad_(True)
    s_plus, s_minus = checked_score(score_fn, both, sigma.repeat(2)).chunk(2)
    loss = _flat_sq(s_plus + s_minus) / 8 + _dot(s_plus - s_minus, v) * d / (2 * fd_eps**2)
    return loss * sigma**2
