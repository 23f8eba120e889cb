"""Annealed Langevin dynamics, and Langevin dynamics on one density, on Gaussian targets, where the stationary law of
each discretised chain is known."""

import math
from copy import deepcopy

import pytest
import torch
from jsonargparse import lazy_instance

from deqscore.errors import ConfigError
from deqscore.sampling import AnnealedLangevin, Langevin
from deqscore.sampling.langevin import REF_NOISE, REF_STEP, plain_copy

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


# ----- Langevin dynamics on one density (energy models) -------------------------------------------------------
MEAN = torch.tensor([1.0, -2.0], dtype=torch.float64)
COV = torch.tensor([[2.0, 0.9], [0.9, 1.0]], dtype=torch.float64)


def gaussian_log_density(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised log N(MEAN, COV)."""
    d = x - MEAN
    return -0.5 * (d @ torch.linalg.inv(COV) * d).sum(1)


def test_metropolis_adjusted_chain_recovers_mean_and_covariance():
    n = 4000  # independent chains: their end points are i.i.d. draws of the chain's law
    chain = Langevin(n_steps=300, step_size=0.3, progress=False)
    x = chain(gaussian_log_density, (n, 2), torch.Generator().manual_seed(0), dtype=torch.float64)
    var = torch.diagonal(COV)
    assert (x.mean(0) - MEAN).abs().le(4 * (var / n).sqrt()).all(), x.mean(0)  # 4 standard errors
    # the standard error of a sample covariance entry of a Gaussian: sqrt((S_ii S_jj + S_ij^2) / n)
    cov_se = ((var[:, None] * var[None, :] + COV**2) / n).sqrt()
    assert (torch.cov(x.T) - COV).abs().le(4 * cov_se).all(), torch.cov(x.T)
    assert 0.5 < chain.acceptance < 1.0  # moves were rejected: the correction did work


def test_the_adjustment_removes_the_unadjusted_chains_known_bias():
    """On N(0, 1) with eps = 0.5 the unadjusted chain's stationary variance is 1 / (1 - eps / 2) = 4/3; MALA's is 1."""
    n, eps = 4000, 0.5
    args = (lambda x: -0.5 * x.pow(2).sum(1), (n, 2), torch.Generator().manual_seed(1))
    unadjusted = Langevin(n_steps=100, step_size=eps, metropolis=False, progress=False)(*args, dtype=torch.float64)
    adjusted = Langevin(n_steps=100, step_size=eps, progress=False)(*args, dtype=torch.float64)
    se = math.sqrt(2 / (2 * n))  # of a unit variance estimated from 2n draws
    assert unadjusted.var().item() == pytest.approx(_ula_variance(1.0, eps), abs=4 * se * 4 / 3)
    assert adjusted.var().item() == pytest.approx(1.0, abs=4 * se)
    # a score alone drives the unadjusted chain the same way as the log-density's gradient
    by_score = Langevin(n_steps=100, step_size=eps, metropolis=False, progress=False)(
        None, (n, 2), torch.Generator().manual_seed(1), dtype=torch.float64, score=lambda x: -x)
    assert torch.allclose(by_score, unadjusted)


def test_langevin_is_seeded_and_refuses_what_it_cannot_do():
    run = lambda seed: Langevin(n_steps=5, progress=False)(  # noqa: E731
        gaussian_log_density, (8, 2), torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert torch.equal(run(3), run(3)) and not torch.equal(run(3), run(4))
    with pytest.raises(ConfigError, match="metropolis needs the model's log-density"):
        Langevin(progress=False)(None, (2, 2), score=lambda x: -x)
    for option in ({"n_steps": 0}, {"step_size": -0.1}, {"step_size": math.nan}, {"init_std": 0.0}):
        with pytest.raises(ConfigError, match=next(iter(option))):
            Langevin(**option)


def test_a_default_sampler_becomes_a_plain_copy():
    default = lazy_instance(Langevin, step_size=0.2)
    copy = plain_copy(default)
    assert type(copy) is Langevin and copy is not default and copy.step_size == 0.2 and copy.n_steps == 500
    assert deepcopy(copy).step_size == 0.2  # what weight averaging does to a module (a lazy instance cannot)
    given = Langevin(n_steps=3)
    assert plain_copy(given) is given


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
