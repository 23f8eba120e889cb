"""Score-matching losses and a factory that builds them by name.

>>> import torch
>>> loss_fn = make_score_loss("ssm_vr", n_projections=2)
>>> loss_fn(lambda x: -x, torch.randn(5, 3)).shape
torch.Size([5])
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .annealed import annealed_dsm, annealed_fd_ssm, annealed_ssm_vr, geometric_sigmas
from .score_matching import (
    DSM_SCALINGS,
    PROJECTIONS,
    denoising_score_matching,
    exact_score_matching,
    random_projections,
    score_from_energy,
    score_from_log_prob,
    sliced_score_matching,
)

ScoreLoss = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]

SCORE_LOSSES = ("exact", "ssm", "ssm_vr", "dsm")


def make_score_loss(
    name: str,
    n_projections: int = 1,
    projection: str = "rademacher",
    dsm_sigma: float = 0.16,
    dsm_scaling: str = "sigma2",
) -> ScoreLoss:
    """Return ``loss(score_fn, x) -> [B]`` for ``name`` in :data:`SCORE_LOSSES` (all options are checked).

    Args:
        n_projections: projections per sample (ssm, ssm_vr).
        projection: ``rademacher`` | ``gaussian`` | ``sphere`` (ssm, ssm_vr).
        dsm_sigma: DSM noise level.
        dsm_scaling: ``sigma2`` (standard sigma^2 weighting) or ``sigma4`` (the reference code's).
    """
    if n_projections < 1:
        raise ValueError(f"n_projections must be >= 1, got {n_projections}")
    if projection not in PROJECTIONS:
        raise ValueError(f"unknown projection {projection!r}; choose one of {PROJECTIONS}")
    if dsm_sigma <= 0:
        raise ValueError(f"dsm_sigma must be positive, got {dsm_sigma}")
    if dsm_scaling not in DSM_SCALINGS:
        raise ValueError(f"unknown DSM scaling {dsm_scaling!r}; choose one of {DSM_SCALINGS}")
    if name == "exact":
        return exact_score_matching
    if name in ("ssm", "ssm_vr"):
        return partial(
            sliced_score_matching, n_projections=n_projections, projection=projection,
            variance_reduction=name == "ssm_vr",
        )
    if name == "dsm":
        return partial(denoising_score_matching, sigma=dsm_sigma, scaling=dsm_scaling)
    raise ValueError(f"unknown score-matching loss {name!r}; choose one of {SCORE_LOSSES}")


__all__ = [
    "DSM_SCALINGS",
    "PROJECTIONS",
    "SCORE_LOSSES",
    "annealed_dsm",
    "annealed_fd_ssm",
    "annealed_ssm_vr",
    "denoising_score_matching",
    "exact_score_matching",
    "geometric_sigmas",
    "make_score_loss",
    "random_projections",
    "score_from_energy",
    "score_from_log_prob",
    "sliced_score_matching",
]
