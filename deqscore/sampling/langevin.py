"""Langevin dynamics: annealed for noise-conditional score networks (docs/method.md section 4.4), and on one fixed
density for energy models (:class:`Langevin`).

For each level ``sigma_i`` of a decreasing schedule, ``n_steps_each`` steps with
``alpha_i = step_lr * (sigma_i / sigma_L)^2`` and fresh ``n ~ N(0, I)``:

* ``variant="standard"`` (NCSNv2): ``x <- x + alpha_i s(x, sigma_i) + sqrt(2 alpha_i) n``;
* ``variant="reference"``: the reference code's step as it runs: the first step of a level is standard, later
  ones ``x <- x + 0.6667 alpha_i s + sqrt(2 alpha_i) n - 0.3333 sqrt(2 alpha_i) n_prev`` (its ``x_old`` is
  overwritten before use, so the intended momentum term vanishes; the noise of the previous step is subtracted).

``final_denoise`` adds one step ``x <- x + sigma_L^2 s(x, sigma_L)`` (Tweedie's denoiser at the last level), as
NCSNv2 reports FID with and without. Starts from ``U[0, 1]`` (``init="uniform"``) or ``N(0, sigma_1^2 I)``
(``init="gaussian"``). All noise comes from one generator: the same seed gives the same samples.

>>> import torch
>>> sampler = AnnealedLangevin(n_steps_each=20, step_lr=1e-3, progress=False)
>>> sigmas = torch.tensor([1.0, 0.5, 0.1])
>>> x = sampler(lambda x, s: -x / (1 + s[:, None] ** 2), (256, 2), sigmas, torch.Generator().manual_seed(0))
>>> x.shape
torch.Size([256, 2])

:class:`Langevin` targets one unnormalised density ``p~``: ``x' = x + eps grad log p~(x) + sqrt(2 eps) n``, from
``N(0, init_std^2 I)``; with ``metropolis`` (MALA) each move is accepted with probability
``min(1, p~(x') q(x | x') / (p~(x) q(x' | x)))``, ``q`` the Gaussian proposal, so the chain leaves ``p~`` itself
invariant; without it (the unadjusted chain, the only one for a model that gives a score but no log-density) the
stationary law is off by O(eps) (for ``N(0, lambda)``: variance ``lambda / (1 - eps / (2 lambda))``).

>>> chain = Langevin(n_steps=200, step_size=0.5, progress=False)
>>> x = chain(lambda x: -0.5 * x.pow(2).sum(1), (4000, 2), torch.Generator().manual_seed(0))
>>> round(float(x.var()), 1), 0.5 < chain.acceptance < 1
(1.0, True)
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, check_count, check_real, choice_error
from ..losses import check_decreasing

Tensor = torch.Tensor
CondScoreFn = Callable[[Tensor, Tensor], Tensor]
PointFn = Callable[[Tensor], Tensor]
LANGEVIN_VARIANTS = ("standard", "reference")
LANGEVIN_INITS = ("uniform", "gaussian")
REF_STEP, REF_NOISE = 0.6667, 0.3333  # the reference code's rounded 2/3 and 1/3


class AnnealedLangevin:
    """Annealed Langevin sampler; see the module docstring.

    Args:
        n_steps_each: T, steps per noise level.
        step_lr: base step size ``epsilon`` (``alpha_i = epsilon (sigma_i / sigma_L)^2``).
        final_denoise: finish with ``x + sigma_L^2 s(x, sigma_L)``.
        variant: ``"standard"`` or ``"reference"``.
        init: ``"uniform"`` (U[0, 1], data in [0, 1]) or ``"gaussian"`` (N(0, sigma_1^2 I)).
        progress: show a progress bar over the levels.
    """

    def __init__(
        self,
        n_steps_each: int = 5,  # T: Langevin steps per noise level
        step_lr: float = 6.2e-6,  # epsilon: alpha_i = epsilon * (sigma_i / sigma_L)^2 (CIFAR-10 value)
        final_denoise: bool = True,  # one last x + sigma_L^2 s(x, sigma_L) step
        variant: Literal["standard", "reference"] = "standard",  # the NCSNv2 step or the reference code's
        init: Literal["uniform", "gaussian"] = "uniform",  # start distribution
        progress: bool = True,  # progress bar over the noise levels
    ):
        check_count("n_steps_each", n_steps_each)
        check_real("step_lr", step_lr)
        if variant not in LANGEVIN_VARIANTS:
            raise choice_error("Langevin variant", variant, LANGEVIN_VARIANTS)
        if init not in LANGEVIN_INITS:
            raise choice_error("Langevin init", init, LANGEVIN_INITS)
        self.n_steps_each, self.step_lr, self.final_denoise = n_steps_each, step_lr, final_denoise
        self.variant, self.init, self.progress = variant, init, progress

    def initial(self, shape: tuple[int, ...], sigmas: Tensor, generator: torch.Generator,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
        if self.init == "uniform":
            return torch.rand(shape, generator=generator, device=device, dtype=dtype)
        return float(sigmas[0]) * torch.randn(shape, generator=generator, device=device, dtype=dtype)

    @torch.no_grad()
    def __call__(self, score_fn: CondScoreFn, shape: tuple[int, ...], sigmas: Tensor,
                 generator: torch.Generator | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> Tensor:
        """Samples of ``shape`` (batch first) from ``score_fn(x, sigma [B]) -> s``, annealed over ``sigmas``."""
        sigmas = check_decreasing(torch.as_tensor(sigmas, dtype=torch.float64).cpu())
        gen = generator or torch.Generator(device=device).manual_seed(0)
        x = self.initial(shape, sigmas, gen, device, dtype)
        sigma_last = float(sigmas[-1])
        for sigma in tqdm(sigmas.tolist(), desc="Langevin", unit="level", disable=not self.progress, leave=False):
            alpha = self.step_lr * (sigma / sigma_last) ** 2
            level = torch.full((shape[0],), sigma, device=device, dtype=dtype)
            noise_prev = None
            for _ in range(self.n_steps_each):
                noise = math.sqrt(2 * alpha) * torch.randn(shape, generator=gen, device=device, dtype=dtype)
                step = alpha * score_fn(x, level)
                if self.variant == "reference" and noise_prev is not None:
                    x = x + REF_STEP * step + noise - REF_NOISE * noise_prev
                else:
                    x = x + step + noise
                noise_prev = noise
        if self.final_denoise:
            level = torch.full((shape[0],), sigma_last, device=device, dtype=dtype)
            x = x + sigma_last**2 * score_fn(x, level)
        return x


class Langevin:
    """Langevin dynamics on one unnormalised density, Metropolis-adjusted (MALA) or not; see the module docstring.

    Args:
        n_steps: steps of every chain (one chain per sample).
        step_size: ``eps`` in ``x + eps grad log p~ + sqrt(2 eps) n``.
        metropolis: accept or reject each move (exact stationary law; needs the log-density).
        init_std: the chains start from ``N(0, init_std^2 I)``.
        progress: show a progress bar over the steps.
    """

    def __init__(
        self,
        n_steps: int = 500,  # steps of every chain
        step_size: float = 0.01,  # eps of x + eps grad log p + sqrt(2 eps) n
        metropolis: bool = True,  # MALA: accept or reject each move (exact; needs the log-density)
        init_std: float = 1.0,  # start from N(0, init_std^2 I)
        progress: bool = True,  # progress bar over the steps
    ):
        check_count("n_steps", n_steps)
        check_real("step_size", step_size)
        check_real("init_std", init_std)
        self.n_steps, self.step_size, self.metropolis = n_steps, step_size, metropolis
        self.init_std, self.progress = init_std, progress
        self.acceptance: float | None = None  # the last run's share of accepted moves (MALA)

    def __call__(self, log_density: PointFn | None, shape: tuple[int, ...], generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 score: PointFn | None = None) -> Tensor:
        """Samples of ``shape`` (batch first) from ``log_density(x) -> [B]``; ``score(x)`` (default: the gradient of
        ``log_density``) may be given instead of it for the unadjusted chain."""
        if score is None and log_density is None:
            raise ValueError("Langevin needs a log-density or a score")
        if self.metropolis and log_density is None:
            raise ConfigError("Langevin: metropolis needs the model's log-density; this model gives only a score "
                              "(set metropolis false for the unadjusted chain)")
        gen = generator or torch.Generator(device=device).manual_seed(0)
        eps = self.step_size
        x = self.init_std * torch.randn(shape, generator=gen, device=device, dtype=dtype)
        log_p, grad = self._value_and_score(log_density, score, x)
        accepted = 0.0
        for _ in tqdm(range(self.n_steps), desc="Langevin", unit="step", disable=not self.progress, leave=False):
            noise = torch.randn(shape, generator=gen, device=device, dtype=dtype)
            proposal = x + eps * grad + math.sqrt(2 * eps) * noise
            if not self.metropolis:
                x = proposal
                _, grad = self._value_and_score(log_density, score, x)
                continue
            log_p_new, grad_new = self._value_and_score(log_density, score, proposal)
            # log q(x | x') - log q(x' | x), q(b | a) = N(b; a + eps grad(a), 2 eps I)
            back = (x - proposal - eps * grad_new).flatten(1).pow(2).sum(1)
            forth = noise.flatten(1).pow(2).sum(1) * (2 * eps)
            log_ratio = log_p_new - log_p - (back - forth) / (4 * eps)
            u = torch.rand(shape[0], generator=gen, device=device, dtype=dtype)
            accept = torch.log(u) < log_ratio
            where = accept.view(-1, *[1] * (len(shape) - 1))
            x, grad = torch.where(where, proposal, x), torch.where(where, grad_new, grad)
            log_p = torch.where(accept, log_p_new, log_p)
            accepted += float(accept.float().mean())
        self.acceptance = accepted / self.n_steps if self.metropolis else None
        return x

    @staticmethod
    def _value_and_score(log_density: PointFn | None, score: PointFn | None, x: Tensor) -> tuple[Tensor | None,
                                                                                                    Tensor]:
        if score is not None:
            with torch.no_grad():
                return (None if log_density is None else log_density(x).detach()), score(x).detach()
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            value = log_density(xg)
            (grad,) = torch.autograd.grad(value.sum(), xg)
        return value.detach(), grad.detach()


def seeded_generator(device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded from torch's global RNG: ``torch.manual_seed`` fixes what it draws."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed)


def plain_copy(sampler: Any) -> Any:
    """``sampler``, or a config's default sampler (jsonargparse's ``lazy_instance``: one object shared by every module,
    which weight averaging cannot deep-copy) rebuilt from its options as an instance of its own class."""
    lazy = getattr(sampler, "lazy_get_init_data", None)
    if lazy is None:
        return sampler
    init = lazy().as_dict()
    module, _, name = init["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**init.get("init_args", {}))
