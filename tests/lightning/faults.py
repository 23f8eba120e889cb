"""Faults injected into real training runs by the multi-process tests (importable by every rank)."""

import math
import time

import torch

from deqscore.lightning import NICEModule

STUCK_S = 60.0  # longer than any test waits: the run must stop the stuck rank itself


class NonFiniteOnRankOne(NICEModule):
    """A NICE module whose training loss is NaN on global rank 1 at global step 1, and finite everywhere else."""

    def loss_terms(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        terms = super().loss_terms(x)
        if self.training and self.global_rank == 1 and self.global_step == 1:
            terms["loss"] = terms["loss"] * math.nan
        return terms


class StuckOnRankOne(NICEModule):
    """A NICE module whose rank 1 stops answering at global step 1 (it sleeps in its training step)."""

    def loss_terms(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training and self.global_rank == 1 and self.global_step == 1:
            time.sleep(STUCK_S)
        return super().loss_terms(x)


class NonFiniteValidationOnRankOne(NICEModule):
    """A NICE module whose validation loss is NaN on global rank 1 after the first training step (the sanity check
    before training passes), and finite everywhere else."""

    def loss_terms(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        terms = super().loss_terms(x)
        if not self.training and self.global_rank == 1 and self.global_step >= 1:
            terms["loss"] = terms["loss"] * math.nan
        return terms


SLOW_S = 12.0  # more than two polls of Lightning's watch over the ranks (every 5 s)


class RankOneDiesWhileRankZeroIsSlow(NICEModule):
    """At global step 1, rank 1 exits with status 7 and rank 0 takes ``SLOW_S`` over its step before its next
    collective (a loaded machine): rank 0 learns of the death only after that."""

    def loss_terms(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training and self.global_step == 1:
            if self.global_rank == 1:
                import os

                os._exit(7)
            time.sleep(SLOW_S)
        return super().loss_terms(x)
