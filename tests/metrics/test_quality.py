"""KID against a hand computation of the unbiased polynomial-kernel MMD, its subsets, its standard error over
disjoint blocks, and the one sample-quality function's report (FID@N, KID, the small-N warning)."""

import itertools
import statistics

import numpy as np
import pytest
import torch

from deqscore.metrics import kernel_inception_distance, sample_quality
from deqscore.metrics.quality import kid_standard_error
from deqscore.metrics.statistics import FeatureStats, frechet_distance


def _mmd2_by_hand(x: np.ndarray, y: np.ndarray) -> float:
    """Unbiased MMD^2 with k(a, b) = (a.b / d + 1)^3, by plain loops over pairs."""
    d = x.shape[1]

    def k(a, b):
        return (float(a @ b) / d + 1) ** 3

    m, n = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i, j in itertools.permutations(range(m), 2)) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i, j in itertools.permutations(range(n), 2)) / (n * (n - 1))
    xy = sum(k(a, b) for a in x for b in y) / (m * n)
    return xx + yy - 2 * xy


def test_kid_of_whole_sets_is_the_unbiased_polynomial_mmd():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((7, 5)), rng.standard_normal((7, 5)) + 0.3
    kid = kernel_inception_distance(torch.tensor(x), torch.tensor(y), subsets=3, subset_size=7)
    # with subsets of the whole sets every subset is a permutation: the same value, no spread
    assert kid["kid"] == pytest.approx(_mmd2_by_hand(x, y), rel=1e-10)
    assert kid["kid_std"] == pytest.approx(0.0, abs=1e-12) and kid["kid_subset_size"] == 7


def test_kid_over_subsets_is_the_mean_and_spread_of_subset_mmds():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((12, 4)), rng.standard_normal((9, 4)) * 1.5
    kid = kernel_inception_distance(torch.tensor(x), torch.tensor(y), subsets=4, subset_size=5, seed=3)
    generator = torch.Generator().manual_seed(3)  # the documented draw: samples' subset, then the reference's
    values = []
    for _ in range(4):
        a = torch.randperm(12, generator=generator)[:5].numpy()
        b = torch.randperm(9, generator=generator)[:5].numpy()
        values.append(_mmd2_by_hand(x[a], y[b]))
    assert kid["kid"] == pytest.approx(np.mean(values), rel=1e-10)
    assert kid["kid_std"] == pytest.approx(np.std(values), rel=1e-8)
    short = kernel_inception_distance(torch.tensor(x), torch.tensor(y), subsets=2, subset_size=1000)
    assert short["kid_subset_size"] == 9 and "subset size 9" in short["kid_subset_note"]


def test_kid_standard_error_is_the_spread_of_disjoint_block_mmds_over_the_root_of_their_number():
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((17, 3)), rng.standard_normal((23, 3)) + 0.2
    blocks = [_mmd2_by_hand(y[i * 5:(i + 1) * 5], x[i * 5:(i + 1) * 5]) for i in range(3)]  # 17 // 3 = 5 rows each
    assert kid_standard_error(torch.tensor(x), torch.tensor(y), blocks=3) == pytest.approx(
        np.std(blocks, ddof=1) / np.sqrt(3), rel=1e-8)
    assert kid_standard_error(torch.tensor(x[:5]), torch.tensor(y), blocks=3) is None  # blocks of 1 row: no MMD
    kid = kernel_inception_distance(torch.tensor(x), torch.tensor(y), subsets=2, subset_size=17)
    assert kid["kid_se"] == kid_standard_error(torch.tensor(x), torch.tensor(y)) and kid["kid_se_blocks"] == 5


@pytest.mark.parametrize("shift, low, high", [(0.3, 0.6, 1.5), (0.0, 1.0, 3.5)])
def test_kid_standard_error_against_the_spread_of_kid_over_independent_draws(shift, low, high):
    """The standard error against the spread of KID itself over 30 independent draws of 200 samples and 400
    reference rows. Samples of another distribution (a shift of 0.3, as samples of a network against data): about
    that spread (here 0.88x), where the 100 subsets' standard deviation is less than half of it. Equal
    distributions: larger (here 2.5x), never over-confident: there the variance of an MMD falls as 1/n^2, so blocks
    of n/5 rows are noisier than one estimate on all n."""
    gen = torch.Generator().manual_seed(0)
    kids, errors, spreads = [], [], []
    for seed in range(30):
        kid = kernel_inception_distance(torch.randn(200, 8, generator=gen) + shift, torch.randn(400, 8, generator=gen),
                                        seed=seed)
        kids.append(kid["kid"])
        errors.append(kid["kid_se"])
        spreads.append(kid["kid_std"])
    assert low <= statistics.mean(errors) / statistics.stdev(kids) <= high
    if shift:
        assert statistics.mean(spreads) < 0.5 * statistics.stdev(kids)


def test_sample_quality_reports_fid_at_n_and_kid_and_warns_at_small_n():
    rng = np.random.default_rng(2)
    samples, reference = FeatureStats(dim=6, keep=40), FeatureStats(dim=6, keep=50)
    samples.update(torch.tensor(rng.standard_normal((40, 6)) + 0.5))
    reference.update(torch.tensor(rng.standard_normal((50, 6))))
    with pytest.warns(RuntimeWarning, match="FID of 40 samples: below 2048"):
        report = sample_quality(samples, reference.gaussian(), seed=0)
    assert report["label"] == "FID@40" and report["num_samples"] == 40
    assert report["fid"] == pytest.approx(frechet_distance(samples, reference), rel=1e-12)
    expected = kernel_inception_distance(samples.features, reference.features, seed=0)["kid"]
    assert report["kid"] == pytest.approx(expected) and report["kid"] > 0  # shifted means: a positive distance
    assert report["kid_se"] == kid_standard_error(samples.features, reference.features) > 0
    published = reference.gaussian().__class__(reference.mu, reference.sigma)  # moments only, as published stats
    with pytest.warns(RuntimeWarning):
        assert sample_quality(samples, published)["kid"] is None
