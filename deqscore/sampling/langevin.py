"""Annealed Langevin dynamics for noise-conditional score networks (docs/method.md section 4.4).

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from tqdm.auto import tqdm

from ..errors import check_count, check_real, choice_error
from ..losses import check_decreasing

Tensor = torch.Tensor
CondScoreFn = Callable[[Tensor, Tensor], Tensor]
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
