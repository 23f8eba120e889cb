"""Score-matching losses: functions of a score function, and configurable loss objects built from them.

The functions (:func:`exact_score_matching`, :func:`sliced_score_matching`, ...) take ``score_fn`` and a
batch and return the per-sample loss; the loss objects (:class:`ExactSM`, :class:`SSM`, :class:`SSMVR`,
:class:`DSM`, :class:`AnnealedDSM`, ...) hold their options and are what configs choose, by a short name
(:func:`loss_names`) or a ``class_path``. This package depends on score functions only; losses tied to one
model (NICE's approximate backprop) live with that model.

>>> import torch
>>> build_loss("ssm_vr")(lambda x: -x, torch.randn(5, 3)).shape
torch.Size([5])
"""

from __future__ import annotations

from .annealed import (
    SCHEDULES,
    annealed_dsm,
    annealed_fd_ssm,
    annealed_ssm_vr,
    check_decreasing,
    dsm_every_level,
    geometric_sigmas,
    linear_sigmas,
    noise_schedule,
)
from .objectives import (
    DSM,
    SSM,
    SSMVR,
    AnnealedDSM,
    AnnealedFDSSM,
    AnnealedLoss,
    AnnealedSSMVR,
    ExactSM,
    Loss,
    ScoreLoss,
    build_loss,
    loss_names,
    register_loss,
)
from .score_matching import (
    DSM_WEIGHTINGS,
    PROJECTIONS,
    denoising_score_matching,
    exact_score_matching,
    random_projections,
    score_from_energy,
    score_from_log_prob,
    sliced_score_matching,
)

__all__ = [
    "DSM",
    "DSM_WEIGHTINGS",
    "PROJECTIONS",
    "SCHEDULES",
    "SSM",
    "SSMVR",
    "AnnealedDSM",
    "AnnealedFDSSM",
    "AnnealedLoss",
    "AnnealedSSMVR",
    "ExactSM",
    "Loss",
    "ScoreLoss",
    "annealed_dsm",
    "annealed_fd_ssm",
    "annealed_ssm_vr",
    "build_loss",
    "check_decreasing",
    "denoising_score_matching",
    "dsm_every_level",
    "exact_score_matching",
    "geometric_sigmas",
    "linear_sigmas",
    "loss_names",
    "noise_schedule",
    "random_projections",
    "register_loss",
    "score_from_energy",
    "score_from_log_prob",
    "sliced_score_matching",
]
