"""Dequantisation, logit transform, its log-determinant and the bits/dim conversion."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deqscore.data import (
    TRANSFORMS,
    bits_per_dim,
    dequantize,
    dequantize_squeeze,
    inverse_logit,
    inverse_squeeze,
    logit_log_det,
    logit_transform,
    preprocess,
    to_unit,
)

ALPHA = 1e-3


def _all_pixels(repeats: int) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).repeat(repeats, 1)


def test_dequantize_range_and_noise_bound():
    images = _all_pixels(2000)
    x = dequantize(images, generator=torch.Generator().manual_seed(0))
    assert x.dtype == torch.float32 and x.shape == images.shape
    assert x.min() >= ALPHA and x.max() <= 1 - ALPHA
    assert x.min() == pytest.approx(ALPHA) and x.max() == pytest.approx(1 - ALPHA)
    noise = x.double() - images.double() / 255
    assert noise.abs().max() <= 1 / 512 + 1e-6
    # interior pixels carry the full uniform noise: mean 0, std (1/256)/sqrt(12), range close to +-1/512
    inner = noise[:, 1:-1]
    sd = 1 / 256 / math.sqrt(12)
    assert inner.mean().abs() < 5 * sd / math.sqrt(inner.numel())  # 5 standard errors
    assert inner.std().item() == pytest.approx(sd, rel=0.01)
    assert inner.max() > 1 / 512 - 1e-5 and inner.min() < -1 / 512 + 1e-5


def test_dequantize_clamps_black_pixels_as_the_spec_says():
    x = dequantize(torch.zeros(200_000, dtype=torch.uint8), generator=torch.Generator().manual_seed(1))
    # P(noise < 1e-3) = (1e-3 + 1/512) / (1/256) = 0.756 (docs/method.md section 4.1: "about 76%")
    assert (x == ALPHA).float().mean().item() == pytest.approx(0.756, abs=0.005)


def test_dequantize_generator_reproducible_and_fresh_without():
    images = _all_pixels(3)
    a = dequantize(images, generator=torch.Generator().manual_seed(5))
    b = dequantize(images, generator=torch.Generator().manual_seed(5))
    c = dequantize(images)
    d = dequantize(images)
    assert torch.equal(a, b)
    assert not torch.equal(c, d)


def test_squeeze_keeps_every_value_in_its_pixel_bin():
    images = _all_pixels(500)
    x = dequantize_squeeze(
        images, generator=torch.Generator().manual_seed(2), alpha=ALPHA, dtype=torch.float64
    )
    assert x.min() >= ALPHA and x.max() <= 1 - ALPHA
    x_tilde = inverse_squeeze(x, ALPHA)
    assert torch.equal(torch.floor(x_tilde * 256).long(), images.long())


def test_logit_round_trip_and_values():
    x = torch.linspace(ALPHA, 1 - ALPHA, 1001, dtype=torch.float64)
    y = logit_transform(x, ALPHA)
    assert torch.allclose(inverse_logit(y), x, atol=1e-12)
    assert torch.allclose(y, torch.log(x / (1 - x)))
    assert y[0].item() == pytest.approx(math.log(ALPHA / (1 - ALPHA)))
    assert y[500].item() == pytest.approx(0.0, abs=1e-12)
    # values outside the interval are clamped first
    assert logit_transform(torch.tensor([0.0, 1.0]), ALPHA).tolist() == pytest.approx(
        [math.log(ALPHA / (1 - ALPHA)), math.log((1 - ALPHA) / ALPHA)], rel=1e-5
    )


def test_logit_log_det_matches_finite_differences():
    x = torch.rand(4, 784, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 0.98 + 0.01
    h = 1e-6
    derivative = (logit_transform(x + h, 0.0) - logit_transform(x - h, 0.0)) / (2 * h)
    expected = torch.log(derivative).sum(dim=1)
    got = logit_log_det(x)
    assert got.shape == (4,)
    assert torch.allclose(got, expected, rtol=1e-8, atol=1e-6)
    # and against the Jacobian from autograd for a single sample
    xs = x[0].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(logit_transform(xs, 0.0).sum(), xs)
    assert got[0].item() == pytest.approx(torch.log(grad).sum().item(), rel=1e-10)


def test_logit_log_det_sums_over_all_non_batch_dims():
    x = torch.full((3, 1, 28, 28), 0.5)
    assert torch.allclose(logit_log_det(x), torch.full((3,), 784 * math.log(4.0)))


@pytest.mark.parametrize("alpha", [0.0, ALPHA, 0.05])
def test_bits_per_dim_is_eight_for_the_uniform_density(alpha):
    """x~ ~ U[0,1]^D has log p(x~) = 0, so bits/dim = log2(256) = 8 exactly, whatever the squeeze."""
    D = 784
    x_tilde = torch.rand(16, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    x = alpha + (1 - 2 * alpha) * x_tilde
    y = logit_transform(x, 0.0)
    # density of y = logit(alpha + (1 - 2 alpha) x~) under x~ ~ U(0, 1), by change of variables
    log_prob_y = (torch.log(x) + torch.log1p(-x)).sum(dim=1) - D * math.log1p(-2 * alpha)
    bpd = bits_per_dim(log_prob_y, inverse_logit(y), alpha=alpha)
    assert torch.allclose(bpd, torch.full_like(bpd, 8.0), atol=1e-9)


def test_bits_per_dim_standard_normal_closed_form():
    """y ~ N(0, I) in logit space: compare with an independent float64 numpy evaluation."""
    rng = np.random.default_rng(5)
    x = rng.uniform(0.01, 0.99, size=(8, 784))
    y = np.log(x) - np.log1p(-x)
    log_prob = (-0.5 * y**2 - 0.5 * np.log(2 * np.pi)).sum(axis=1)
    # density of x on the unit cube: phi(logit x) / (x (1 - x)); then per-dim bits on the 256-level scale
    density_x = np.exp(-0.5 * y**2) / np.sqrt(2 * np.pi) / (x * (1 - x))
    expected = np.mean(8.0 - np.log2(density_x), axis=1)
    got = bits_per_dim(torch.from_numpy(log_prob), torch.from_numpy(x))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    # n_bins enters only through the log2(n_bins) offset
    got16 = bits_per_dim(torch.from_numpy(log_prob), torch.from_numpy(x), n_bins=16)
    np.testing.assert_allclose((got - got16).numpy(), 4.0, rtol=1e-12)


def test_bits_per_dim_shape_check():
    with pytest.raises(ValueError, match="shape"):
        bits_per_dim(torch.zeros(3, 1), torch.full((3, 784), 0.5))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_preprocess_then_to_unit_recovers_pixels(transform):
    images = _all_pixels(50)
    x = preprocess(images, transform, ALPHA, torch.Generator().manual_seed(6))
    assert x.dtype == torch.float32 and x.shape == images.shape
    back = to_unit(x, transform, ALPHA)
    assert back.min() >= 0 and back.max() <= 1
    if transform == "logit_squeeze":  # inside the pixel's bin [k/256, (k+1)/256)
        scaled = back.double() * 256 - images.double()
        assert scaled.min() >= -1e-3 and scaled.max() <= 1 + 1e-3
    else:  # within the dequantisation half-width of k/255
        assert (back.double() - images.double() / 255).abs().max() <= 1 / 512 + 1e-5
    if transform == "unit":
        assert x.min() >= ALPHA and x.max() <= 1 - ALPHA
    else:
        bound = math.log((1 - ALPHA) / ALPHA)
        assert x.abs().max() <= bound + 1e-4


def test_unknown_transform_lists_choices():
    with pytest.raises(ValueError, match="'logit', 'unit', 'logit_squeeze'"):
        preprocess(_all_pixels(1), "tanh")
    with pytest.raises(ValueError, match="alpha > 0"):
        preprocess(_all_pixels(1), "logit", alpha=0.0)
