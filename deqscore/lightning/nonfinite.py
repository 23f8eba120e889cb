"""Stopping a non-finite step before it reaches the weights: the loss and gradient checks of every
:class:`~deqscore.lightning.base.ScoreModule` (a mixin of it, using its trainer, steps and DEQ layers).

One process reads each check as it is made. A sync-free step (``sync_free_steps``) records them, and with the DEQ
layers' deferred statistics reads them by one host sync in :meth:`NonFiniteStops.on_before_optimizer_step`. With
several processes the checks are read on every rank at the same point (after the backward in training, at the
end of an evaluation epoch), so all ranks stop together and none waits in a collective for one that raised alone.
Every stop is worded by :meth:`NonFiniteStops._non_finite_message`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from ..finite import DeferredChecks, active_checks
from ..privates import attached_trainer


class NonFiniteLossError(FloatingPointError):
    """A NaN/Inf loss or gradient: training stops before the parameters are touched."""


class NonFiniteStops:
    """The checks; mixed into :class:`~deqscore.lightning.base.ScoreModule`, whose ``sync_free_steps``, trainer,
    steps and DEQ layers they read."""

    _checks: DeferredChecks | None = None  # the pending checks of the current (sync-free) training step
    _eval_finite: torch.Tensor | None = None  # with several processes: this evaluation epoch's losses all finite

    def check_finite(self, loss: torch.Tensor, stage: str) -> None:
        """Raise :class:`NonFiniteLossError` for a NaN/Inf loss, before any update (in a sync-free step: recorded,
        and raised by :meth:`on_before_optimizer_step`)."""
        checks = active_checks()
        if checks is not None:
            checks.add(torch.isfinite(loss).all(), f"{stage} loss")
            return
        if stage != "train" and self._several_processes:  # read on every rank at the epoch's end, see there
            finite = torch.isfinite(loss).all()
            self._eval_finite = finite if self._eval_finite is None else self._eval_finite & finite
            return
        if not torch.isfinite(loss):
            raise NonFiniteLossError(self._non_finite_message({0: [f"{stage} loss ({loss.item()})"]}))

    def on_validation_epoch_end(self) -> None:
        self._stop_on_a_non_finite_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._stop_on_a_non_finite_evaluation("test")

    def _stop_on_a_non_finite_evaluation(self, stage: str) -> None:
        """With several processes, every rank reads the epoch's loss checks here, together: a rank that raised alone
        in its step would leave the others in the epoch's metric sync. All stop, before any checkpoint of it."""
        if not self._several_processes:
            return
        finite = self._eval_finite if self._eval_finite is not None else torch.ones((), dtype=torch.bool)
        self._eval_finite = None
        flags = self._on_every_rank(finite.reshape(1).to(self.device, torch.float32))[:, 0].tolist()
        bad = {rank: [f"{stage} loss"] for rank, ok in enumerate(flags) if not ok}
        if bad:
            raise NonFiniteLossError(self._non_finite_message(bad))

    def _grad_scaler(self) -> Any:
        """The precision plugin's gradient scaler (``16-mixed``), or None."""
        trainer = attached_trainer(self)
        return getattr(getattr(trainer, "precision_plugin", None), "scaler", None) if trainer is not None else None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Under 16-mixed a non-finite gradient is the gradient scaler's business: it skips that update and lowers
        # the scale (the first steps overflow by design); the loss and input checks still stop the run.
        named = [] if self._grad_scaler() is not None else [
            (name, p.grad) for name, p in self.named_parameters() if p.grad is not None]
        if self._deferred_checks:
            self._sync_free_guard(named)
            return
        finite = torch.stack([torch.isfinite(g).all() for _, g in named]) if named else torch.ones(0, dtype=bool)
        if not bool(finite.all()):  # one device sync per step
            bad = [f"gradient of {name}" for (name, _), ok in zip(named, finite.tolist(), strict=True) if not ok]
            raise NonFiniteLossError(self._non_finite_message({0: bad}))

    @property
    def _several_processes(self) -> bool:
        trainer = attached_trainer(self)
        return trainer is not None and trainer.world_size > 1

    @property
    def _deferred_checks(self) -> bool:
        # With several processes a step's finiteness checks are read on every rank at the same point, after the
        # backward: a rank that raised alone in its forward would leave the others waiting in the gradient
        # all-reduce until the process group's timeout.
        return self.sync_free_steps or self._several_processes

    def _on_every_rank(self, flags: torch.Tensor) -> torch.Tensor:
        """``[world, n]``: the step's check flags of every process (a collective under DDP, reached by every rank
        in the same step), or ``[1, n]`` for one process."""
        if not self._several_processes:
            return flags[None]
        rows = [torch.empty_like(flags) for _ in range(self.trainer.world_size)]
        torch.distributed.all_gather(rows, flags.contiguous())
        return torch.stack(rows)

    def _logging_step(self) -> bool:
        trainer = attached_trainer(self)
        return trainer is not None and (self.global_step + 1) % max(trainer.log_every_n_steps, 1) == 0

    def _sync_free_guard(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """The one host sync of a sync-free training step: the step's finiteness checks (inputs, loss, every
        gradient) and, at logging steps, the DEQ layers' convergence counts, read as one tensor."""
        checks, self._checks = self._checks or DeferredChecks(), None
        for name, grad in named:
            checks.add(torch.isfinite(grad).all(), f"gradient of {name}")
        pending = [(d, d.take_deferred()) for d in self.deq_layers()] if self._logging_step() else []
        flags = self._on_every_rank(checks.stacked().to(self.device, torch.float32))
        counts = [v.float().reshape(1) for _, p in pending for v in p.values()]
        values = torch.cat([flags.flatten(), *counts]).tolist()  # the step's one host sync
        n = len(checks)
        bad = {rank: [name for name, ok in zip(checks.names, values[rank * n:(rank + 1) * n], strict=True) if not ok]
               for rank in range(flags.shape[0])}
        if any(bad.values()):
            raise NonFiniteLossError(self._non_finite_message({rank: names for rank, names in bad.items() if names}))
        total: dict[str, float] = defaultdict(float)
        it = iter(values[flags.numel():])
        for _, p in pending:
            for name in p:
                total[name] += next(it)
        if pending and total:  # one warning for all layers per logging interval
            next(d for d, p in pending if p).report_deferred(dict(total))

    def _non_finite_message(self, bad: dict[int, list[str]]) -> str:
        """One line: what was non-finite (on which ranks, with several processes), and that nothing was updated; every
        non-finite stop is worded here."""
        where = f"at global step {self.global_step}, epoch {self.current_epoch}"
        if not self._several_processes:
            return f"non-finite {', '.join(bad[0])} {where}: training stopped before the update, last good " \
                   "checkpoint kept"

        def what(names: list[str]) -> str:  # a non-finite loss spreads to every gradient through the all-reduce
            grads = [n for n in names if n.startswith("gradient of ")]
            rest = [n for n in names if n not in grads]
            return ", ".join(rest + ([f"{len(grads)} gradients"] if grads else []))

        ranks = "; ".join(f"rank {rank}: {what(names)}" for rank, names in sorted(bad.items()))
        return (f"non-finite values {where} ({ranks}): every process stopped before the update, last good "
                "checkpoint kept")
