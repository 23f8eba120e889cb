"""Sample quality: FID and KID of the same Inception features, the one function every caller uses.

:func:`sample_quality` takes the feature statistics of N samples (their moments, and the first of their features)
and the reference statistics of a data set, and returns the Frechet distance (FID@N, float64 moments) and the
Kernel Inception Distance: the unbiased MMD^2 with the cubic polynomial kernel ``k(x, y) = (x.y / d + 1)^3``,
averaged over ``subsets`` random subsets of ``subset_size`` samples and reference features (torch-fidelity's and
torchmetrics' protocol, mean and population standard deviation over the subsets). When fewer than ``subset_size``
features are at hand on either side, the subset size is that number, and the result says so. The subsets overlap
(where the samples are fewer than ``subset_size``, every subset holds all of them), so their standard deviation is
no standard error; :func:`kid_standard_error` gives one, from disjoint blocks of the samples. FID is strongly
biased at small N (its estimate falls as N grows): below :data:`FID_MIN_SAMPLES` (2048, the feature dimension) a
warning says so; KID is unbiased at any N.

>>> import numpy as np
>>> g = torch.randn(50, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
>>> kid = kernel_inception_distance(g[:25], g[25:], subsets=10, subset_size=25)
>>> kid["kid_subset_size"], abs(kid["kid"]) < 0.05
(25, True)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torchmetrics.image.kid import poly_mmd

from .statistics import FeatureStats, GaussianStats, frechet_distance

FID_MIN_SAMPLES = 2048  # below the feature dimension the sample covariance is singular and FID strongly biased
KID_SUBSETS = 100
KID_SUBSET_SIZE = 1000
KID_BLOCKS = 5  # disjoint sample blocks for KID's standard error
KID_FEATURES = 10_000  # sample features kept for KID (the moments of all N make FID)


class SampleFeatures:
    """The Inception features of samples as they are drawn, for :func:`sample_quality`: the moments of all of them
    (FID) and the first :data:`KID_FEATURES` (KID). The one accumulator of the training callback and of
    ``sample.py --fid``."""

    def __init__(self, extractor: Callable[[torch.Tensor], torch.Tensor]):
        self.extractor = extractor
        self.stats = FeatureStats(keep=KID_FEATURES)

    def add(self, images: torch.Tensor) -> None:
        self.stats.update(self.extractor(images))

    def quality(self, reference: GaussianStats, seed: int = 0) -> dict[str, Any]:
        return sample_quality(self.stats, reference, seed=seed)


def kernel_inception_distance(samples: torch.Tensor, reference: torch.Tensor, subsets: int = KID_SUBSETS,
                              subset_size: int = KID_SUBSET_SIZE, seed: int = 0) -> dict[str, Any]:
    """KID of two feature sets ``[n, d]`` and ``[m, d]``: mean and standard deviation of the unbiased polynomial
    MMD^2 over ``subsets`` subsets of ``min(subset_size, n, m)`` rows of each, drawn with ``seed``."""
    samples, reference = samples.double(), reference.double()
    size = min(subset_size, len(samples), len(reference))
    if size < 2:
        raise ValueError(f"KID needs at least 2 features on each side, got {len(samples)} and {len(reference)}")
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(subsets):
        a = samples[torch.randperm(len(samples), generator=generator)[:size]]
        b = reference[torch.randperm(len(reference), generator=generator)[:size]]
        values.append(poly_mmd(b, a))  # degree 3, gamma 1/d, coef 1
    kid = torch.stack(values)
    return {"kid": float(kid.mean()), "kid_std": float(kid.std(unbiased=False)), "kid_subset_size": size,
            "kid_subsets": subsets, "kid_subset_note": "" if size == subset_size else (
                f"subset size {size}, below the standard {subset_size}: fewer features were available"),
            "kid_se": kid_standard_error(samples, reference), "kid_se_blocks": KID_BLOCKS}


def kid_blocks(samples: torch.Tensor, reference: torch.Tensor, blocks: int = KID_BLOCKS) -> torch.Tensor | None:
    """``blocks`` independent KIDs: the unbiased MMD^2 of each of ``blocks`` disjoint blocks of the samples against
    its own disjoint block of the reference of the same size. None where a block would hold fewer than 2 rows."""
    size = min(len(samples), len(reference)) // blocks
    if size < 2:
        return None
    pairs = [(reference[i * size:(i + 1) * size], samples[i * size:(i + 1) * size]) for i in range(blocks)]
    return torch.stack([poly_mmd(ref.double(), own.double()) for ref, own in pairs])


def kid_standard_error(samples: torch.Tensor, reference: torch.Tensor, blocks: int = KID_BLOCKS) -> float | None:
    """KID's standard error: the standard deviation of :func:`kid_blocks` over sqrt(blocks)."""
    values = kid_blocks(samples, reference, blocks)
    return None if values is None else float(values.std()) / math.sqrt(blocks)


def sample_quality(samples: FeatureStats, reference: GaussianStats, seed: int = 0) -> dict[str, Any]:
    """FID@N and KID of ``samples`` against ``reference`` (see the module docstring). KID is None where the reference
    holds no features (published statistics) or the samples kept none."""
    n = samples.count
    if n < FID_MIN_SAMPLES:
        warnings.warn(f"FID of {n} samples: below {FID_MIN_SAMPLES} (the feature dimension) FID is strongly biased "
                      "upwards and comparable only at the same N; KID is unbiased", RuntimeWarning, stacklevel=2)
    report: dict[str, Any] = {"fid": frechet_distance(samples, reference), "num_samples": n,
                              "label": f"FID@{n}", "kid": None, "kid_std": None, "kid_se": None}
    features = samples.features
    if reference.features is not None and len(features) >= 2:
        report |= kernel_inception_distance(features, torch.as_tensor(reference.features), seed=seed)
        report["kid_samples"] = len(features)
    return report
