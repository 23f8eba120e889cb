"""Feature statistics and the Frechet distance (docs/method.md section 4.4).

:class:`FeatureStats` accumulates the count, the sum and the sum of outer products of the features in float64, so
batches, processes (:meth:`FeatureStats.all_reduce` under DDP) and resumed runs add up exactly; mean and (unbiased)
covariance follow. The distance itself is torch-fidelity's ``fid_statistics_to_metric``.

>>> stats = FeatureStats(dim=3)
>>> stats.update(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]], dtype=torch.float64))
>>> stats.count, stats.mu.tolist()
(2, [1.0, 1.0, 1.0])
>>> abs(frechet_distance(stats, stats)) < 1e-6   # eigenvalue round-off of a rank-1 covariance
True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .inception import FEATURE_DIM


class FeatureStats:
    """Running count, sum and sum of outer products (float64) of feature vectors; mean and unbiased covariance.
    The first ``keep`` feature vectors themselves are kept too (float32), for KID, which needs features."""

    def __init__(self, dim: int = FEATURE_DIM, keep: int = 0):
        self.dim, self.count, self.keep = dim, 0, keep
        self.total = torch.zeros(dim, dtype=torch.float64)
        self.outer = torch.zeros(dim, dim, dtype=torch.float64)
        self._kept: list[torch.Tensor] = []

    def update(self, features: torch.Tensor) -> None:
        if features.dim() != 2 or features.shape[1] != self.dim:
            raise ValueError(f"features must have shape [B, {self.dim}], got {tuple(features.shape)}")
        f = features.detach().to("cpu", torch.float64)
        room = self.keep - sum(len(k) for k in self._kept)
        if room > 0:
            self._kept.append(f[:room].float())
        self.count += f.shape[0]
        self.total += f.sum(0)
        self.outer += f.T @ f

    @property
    def features(self) -> torch.Tensor:
        """The kept feature vectors ``[min(count, keep), dim]`` (float32)."""
        return torch.cat(self._kept) if self._kept else torch.empty(0, self.dim)

    def all_reduce(self) -> None:
        """Sum over the processes of a DDP run (a no-op in a single process): every process then holds the
        statistics of all features."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        packed = torch.cat([torch.tensor([float(self.count)], dtype=torch.float64), self.total,
                            self.outer.flatten()]).to(device)
        dist.all_reduce(packed)
        packed = packed.cpu()
        self.count = int(round(packed[0].item()))
        self.total, self.outer = packed[1 : 1 + self.dim], packed[1 + self.dim :].view(self.dim, self.dim)
        if self.keep:  # every process's kept features, in rank order, up to keep in all
            gathered: list[torch.Tensor | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, self.features)
            self._kept = [torch.cat([g for g in gathered if g is not None])[: self.keep]]

    def _check(self) -> None:
        if self.count < 2:
            raise ValueError(f"FID statistics need at least 2 feature vectors, got {self.count}")

    @property
    def mu(self) -> np.ndarray:
        self._check()
        return (self.total / self.count).numpy()

    @property
    def sigma(self) -> np.ndarray:
        self._check()
        mean = self.total / self.count
        return ((self.outer - self.count * torch.outer(mean, mean)) / (self.count - 1)).numpy()

    def gaussian(self) -> GaussianStats:
        return GaussianStats(self.mu, self.sigma, self.count, self.features.numpy() if self.keep else None)


@dataclass(frozen=True)
class GaussianStats:
    """Mean and covariance of a set of features (``count`` of them; 0 when unknown, e.g. published statistics),
    and some of the features themselves where known (for KID)."""

    mu: np.ndarray
    sigma: np.ndarray
    count: int = 0
    features: np.ndarray | None = None


def frechet_distance(a: FeatureStats | GaussianStats, b: FeatureStats | GaussianStats) -> float:
    """FID between two feature distributions, by torch-fidelity's ``fid_statistics_to_metric``."""
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric

    first, second = ({"mu": s.mu.astype(np.float64), "sigma": s.sigma.astype(np.float64)} for s in (a, b))
    if first["mu"].shape != second["mu"].shape:
        raise ValueError(f"FID of features of different sizes: {first['mu'].shape} and {second['mu'].shape}")
    return float(fid_statistics_to_metric(first, second, verbose=False)[KEY_METRIC_FID])
