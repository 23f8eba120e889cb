"""What drawing samples costs: network evaluations per sample and the DEQ solver iterations they took.

A sampler's price on a DEQ model is evaluations x solver iterations per evaluation (each evaluation solves every DEQ
layer once). :func:`counting_cost` counts both with forward hooks while a block of code draws, whatever the
sampler: each call of the network is one evaluation of every sample in its batch, and each solve adds the
iterations its layer recorded (``DEQ.stats.nstep``; warm starts, where the sampler uses them, included).

>>> import torch
>>> from torch import nn
>>> net = nn.Linear(2, 2)
>>> with counting_cost(net) as cost:
...     for _ in range(3):
...         _ = net(torch.zeros(4, 2))
>>> cost.evaluations, cost.solves
(3, 0)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from ..deq import DEQ


@dataclass
class SamplingCost:
    """Counts of one drawing: network calls, DEQ solves, their summed solver iterations, and how many of the solves
    had their layer's warm start on (each starts from its layer's last fixed point where one of its shape exists)."""

    evaluations: int = 0
    solves: int = 0
    iterations: int = 0
    warm_solves: int = 0

    def starts(self) -> str:
        """The solves' starts in words: ``warm start on``, ``warm start off``, or how many had it on."""
        if self.warm_solves in (0, self.solves):
            return f"warm start {'on' if self.warm_solves else 'off'}"
        return f"warm start on in {self.warm_solves} of {self.solves} solves"

    def iterations_per_evaluation(self) -> float:
        """Solver iterations per network evaluation (summed over the DEQ layers of one evaluation)."""
        return self.iterations / max(self.evaluations, 1)

    def describe(self, batches: int) -> str:
        """One line: evaluations per sample (``batches`` draws of the network shared the calls) and, for a DEQ,
        solver iterations per evaluation and per sample, and whether the solves started warm."""
        per_sample = self.evaluations / max(batches, 1)
        text = f"{per_sample:g} network evaluations per sample"
        if self.solves:
            per_eval = self.iterations_per_evaluation()
            text += (f"; DEQ solver iterations {per_eval:.2f} per evaluation, {per_eval * per_sample:,.0f} per "
                     f"sample ({self.starts()})")
        return text


@contextmanager
def counting_cost(net: nn.Module) -> Iterator[SamplingCost]:
    """Count :class:`SamplingCost` for the calls of ``net`` (and of its DEQ layers) inside the ``with`` block."""
    cost = SamplingCost()

    def on_evaluation(*_: object) -> None:
        cost.evaluations += 1

    def on_solve(layer: DEQ, *_: object) -> None:
        if layer.stats is not None:
            cost.solves += 1
            cost.iterations += int(layer.stats.nstep)
            cost.warm_solves += int(layer.warm_start)

    handles = [net.register_forward_hook(on_evaluation)]
    handles += [m.register_forward_hook(on_solve) for m in net.modules() if isinstance(m, DEQ)]
    try:
        yield cost
    finally:
        for handle in handles:
            handle.remove()
