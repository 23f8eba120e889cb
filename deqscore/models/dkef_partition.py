"""DKEF's normaliser by importance sampling: the proposal (a broad Gaussian, or a defensive mixture with Gaussians
at data points), the estimate's summary and its effective sample size."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor


class ImportanceProposal:
    """The proposal of :meth:`DKEF.log_partition`: ``N(0, std^2 I)``, or with ``points`` ``[n, D]`` the defensive
    mixture ``q = 1/2 N(0, std^2 I) + 1/2 mean_i N(points_i, h^2 I)``, ``h = n^(-1/(D + 4))`` (Scott's rule for
    whitened data). The density is exact and the broad half bounds the weights ``p~ / q`` by twice those of the
    Gaussian alone; the point half puts draws where the model's mass is.

    >>> q = ImportanceProposal(1, 2.0, torch.zeros(1, 1, dtype=torch.float64))
    >>> x = torch.tensor([[0.5]], dtype=torch.float64)
    >>> density = lambda s: math.exp(-0.5 * (0.5 / s) ** 2) / math.sqrt(2 * math.pi * s**2)  # N(0.5; 0, s^2)
    >>> round(q.log_prob(x).item() - math.log(0.5 * density(2.0) + 0.5 * density(1.0)), 12)  # h = 1 for n = 1
    0.0
    """

    def __init__(self, dim: int, std: float, points: Tensor | None = None):
        self.dim, self.std, self.points = dim, std, points
        if points is not None:
            if points.ndim != 2 or points.shape[1] != dim or len(points) == 0:
                raise ValueError(f"proposal_points: expected [n >= 1, {dim}], got {list(points.shape)}")
            self.bandwidth = len(points) ** (-1.0 / (dim + 4))

    def _log_normal(self, sq_dist: Tensor, std: float) -> Tensor:
        return -0.5 * self.dim * math.log(2 * math.pi * std**2) - sq_dist / (2 * std**2)

    def log_prob(self, x: Tensor) -> Tensor:
        broad = self._log_normal(x.pow(2).sum(1), self.std)
        if self.points is None:
            return broad
        points = self.points.to(x)
        near = self._log_normal(torch.cdist(x, points).pow(2), self.bandwidth)
        near = torch.logsumexp(near, 1) - math.log(len(points))
        return torch.logaddexp(broad, near) - math.log(2.0)

    def draw(self, n: int, gen: torch.Generator | None, dtype: torch.dtype, device: torch.device) -> Tensor:
        noise = torch.randn(n, self.dim, generator=gen, dtype=dtype, device=device)
        if self.points is None:
            return noise * self.std
        near = torch.rand(n, generator=gen, device=device) < 0.5
        index = torch.randint(len(self.points), (n,), generator=gen, device=device)
        centres = self.points.to(dtype=dtype, device=device)[index]
        return torch.where(near[:, None], centres + self.bandwidth * noise, self.std * noise)


def effective_sample_size(stderr: float, n: int) -> float:
    """The importance sampler's ESS ``(sum w)^2 / sum w^2`` from the standard error of log Z that
    :meth:`DKEF.log_partition` reports for ``n`` draws (the inverse of ``stderr = sqrt((n / ESS - 1) / (n - 1))``).

    >>> round(effective_sample_size(math.sqrt((1000 / 250 - 1) / 999), 1000), 6)
    250.0
    """
    return n / (1.0 + (n - 1) * stderr**2)


def _is_summary(log_sum_w: float, log_sum_w2: float, n: int) -> tuple[float, float]:
    """``(log Z, stderr)`` from ``log sum w`` and ``log sum w^2``; warns on a small ESS or a large stderr."""
    if not (math.isfinite(log_sum_w) and math.isfinite(log_sum_w2)):
        raise ValueError(f"DKEF log_partition: non-finite importance weights (log sum w = {log_sum_w})")
    ess = math.exp(2 * log_sum_w - log_sum_w2)
    stderr = math.sqrt(max(n / ess - 1.0, 0.0) / (n - 1))
    if ess < 100 or stderr > 0.1:
        warnings.warn(
            f"DKEF log_partition: unreliable estimate, effective sample size {ess:.1f} of {n} (want >= 100), "
            f"standard error of log Z {stderr:.3g} (want <= 0.1); use more samples or a better proposal_std",
            RuntimeWarning,
            stacklevel=3,
        )
    return log_sum_w - math.log(n), stderr
