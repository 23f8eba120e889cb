"""Annealed Langevin dynamics on Gaussian targets, where the stationary law of each discretised chain is known."""

import math

import pytest
import torch

from deqscore.errors import ConfigError
from deqscore.sampling import AnnealedLangevin
from deqscore.sampling.langevin import REF_NOISE, REF_STEP

MU, S0 = 0.5, 0.2  # target N(MU, S0^2 I); perturbed at sigma: N(MU, (S0^2 + sigma^2) I)
N, D = 4000, 2


def gaussian_score(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return -(x - MU) / (S0**2 + sigma[:, None] ** 2)


def _run(sampler: AnnealedLangevin, sigmas: list[float], seed: int = 0) -> torch.Tensor:
    return sampler(gaussian_score, (N, D), torch.tensor(sigmas), torch.Generator().manual_seed(seed),
                   dtype=torch.float64)


def _ula_variance(v: float, alpha: float) -> float:
    """Stationary variance of x <- x - alpha (x - mu) / v + sqrt(2 alpha) n."""
    return v / (1 - alpha / (2 * v))


@pytest.mark.parametrize("sigmas", [[0.1], [1.0, 0.5, 0.1]])
def test_standard_chain_reaches_the_discretised_stationary_law(sigmas):
    v, alpha = S0**2 + 0.1**2, 0.02  # alpha / v = 0.4: the step's bias (+25% variance) is far above the noise
    x = _run(AnnealedLangevin(n_steps_each=100, step_lr=alpha, final_denoise=False, progress=False), sigmas)
    assert x.mean().item() == pytest.approx(MU, abs=4 * math.sqrt(_ula_variance(v, alpha) / (N * D)))
    assert x.var().item() == pytest.approx(_ula_variance(v, alpha), rel=0.05)
    assert abs(x.var().item() - v) > 0.1 * v  # the closed form above, not the target's v, is what is matched


def test_final_denoising_step_is_tweedie_at_the_last_level():
    v, alpha, sigma = S0**2 + 0.1**2, 0.02, 0.1
    x = _run(AnnealedLangevin(n_steps_each=100, step_lr=alpha, final_denoise=True, progress=False), [sigma])
    shrink = 1 - sigma**2 / v  # x + sigma^2 s(x) = mu + (x - mu) (1 - sigma^2 / v)
    assert x.mean().item() == pytest.approx(MU, abs=0.01)
    assert x.var().item() == pytest.approx(_ula_variance(v, alpha) * shrink**2, rel=0.05)


def test_reference_variant_matches_its_arma_stationary_variance():
    """x' = a x + b n + c b n_prev with a = 1 - 0.6667 alpha / v, b = sqrt(2 alpha), c = -0.3333:
    Var = b^2 (1 + c^2 + 2 a c) / (1 - a^2)."""
    v, alpha = S0**2 + 0.1**2, 0.02
    x = _run(AnnealedLangevin(n_steps_each=200, step_lr=alpha, final_denoise=False, variant="reference",
                              progress=False), [0.1])
    a, b2, c = 1 - REF_STEP * alpha / v, 2 * alpha, -REF_NOISE
    expected = b2 * (1 + c * c + 2 * a * c) / (1 - a * a)
    assert x.var().item() == pytest.approx(expected, rel=0.05)
    assert abs(expected - _ula_variance(v, alpha)) > 0.1 * expected  # 16% apart: distinguishable at rel=0.05


def test_step_size_follows_sigma_squared_ratio():
    """With one step per level from a point mass at MU the variance after level i is 2 alpha_i, alpha_i =
    step_lr (sigma_i / sigma_L)^2, shrunk by the later levels' contractions: check the two-level case."""
    sigmas, lr = [0.4, 0.1], 1e-3
    sampler = AnnealedLangevin(n_steps_each=1, step_lr=lr, final_denoise=False, init="gaussian", progress=False)
    x0 = torch.full((N, D), MU, dtype=torch.float64)
    sampler.initial = lambda shape, s, gen, device, dtype: x0.clone()  # start at the mean
    x = sampler(gaussian_score, (N, D), torch.tensor(sigmas), torch.Generator().manual_seed(3), dtype=torch.float64)
    a1, a2 = lr * 16, lr
    expected = 2 * a1 * (1 - a2 / (S0**2 + 0.01)) ** 2 + 2 * a2
    assert x.var().item() == pytest.approx(expected, rel=0.05)


def test_same_seed_same_samples_other_seed_other_samples():
    sampler = AnnealedLangevin(n_steps_each=3, step_lr=1e-3, progress=False)
    a, b, c = (_run(sampler, [1.0, 0.1], seed) for seed in (5, 5, 6))
    assert torch.equal(a, b) and not torch.allclose(a, c)


@pytest.mark.parametrize(("kw", "key"), [({"n_steps_each": 0}, "n_steps_each"), ({"step_lr": -1.0}, "step_lr"),
                                          ({"variant": "momentum"}, "variant"), ({"init": "zeros"}, "init")])
def test_bad_options_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        AnnealedLangevin(**kw)


@pytest.mark.parametrize("sigmas", [[0.1, 1.0], [1.0, 1.0], [1.0, -0.1], [1.0, math.nan]])
def test_sigmas_must_be_positive_and_strictly_decreasing(sigmas):
    with pytest.raises(ValueError, match="sigmas"):
        _run(AnnealedLangevin(n_steps_each=1, progress=False), sigmas)


def _mixture_score(centres: torch.Tensor):
    """The exact score of ``centres`` smoothed by sigma: a mixture of N(c_i, sigma^2 I) with equal weights."""
    def score(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(-torch.cdist(x, centres).pow(2) / (2 * sigma[:, None] ** 2), 1)
        return (weights @ centres - x) / sigma[:, None] ** 2
    return score


def test_exact_score_of_smoothed_images_reproduces_the_images():
    # The NCSN MNIST sampler (10 geometric levels 1 -> 0.01, step_lr 2e-5, 10 steps a level) driven by the exact
    # score of 8 binary 28x28 "images": every chain must end at one of them, spread about it as the discretised
    # chain's stationary law at the last level (per-pixel variance sigma_L^2 / (1 - alpha / (2 sigma_L^2)), the
    # Gaussian closed form above, since the nearest image dominates the mixture there). A model whose samples
    # collapse through this sampler therefore has a score error, not a sampler error.
    gen = torch.Generator().manual_seed(0)
    centres = (torch.rand(8, 784, generator=gen, dtype=torch.float64) < 0.15).double()
    sigmas = torch.logspace(0, -2, 10, dtype=torch.float64)
    sampler = AnnealedLangevin(n_steps_each=10, step_lr=2e-5, final_denoise=False, progress=False)
    x = sampler(_mixture_score(centres), (32, 784), sigmas, torch.Generator().manual_seed(1), dtype=torch.float64)
    per_pixel = torch.cdist(x, centres).min(1).values.pow(2) / 784
    assert per_pixel.max().item() < 4 * 0.01**2  # each sample sits on an image
    assert per_pixel.mean().item() == pytest.approx(_ula_variance(0.01**2, 2e-5), rel=0.03)
