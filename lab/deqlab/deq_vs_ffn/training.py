"""Training under the protocol's selection rule: a run continues, doubling its steps, while its validation curve is
still falling (up to ``max_steps``); per architecture the learning rate with the lowest final validation RMSE is
chosen, with its run's step count, on seed 0; further seeds train at that lr for that many steps."""

from __future__ import annotations

import time

import torch
from torch import nn

from deqscore.deq import DEQ
from deqscore.metrics import parameter_count

from ..study.trust import trust_figures
from .networks import Budget, Task, build, clipped_fit_floor, largest_slope, weight_norms


def still_falling(curve: list[tuple[int, float]], protocol: dict) -> bool:
    """The protocol's test of an unfinished run: over the last ``window`` of the steps the validation metric fell
    by more than ``relative_drop`` of its value at the window's start.

    >>> p = {"flattened": {"window": 0.2, "relative_drop": 0.05}}
    >>> still_falling([(80, 1.0), (100, 0.9)], p), still_falling([(80, 1.0), (100, 0.99)], p)
    (True, False)
    """
    rule = protocol["flattened"]
    last_step, last = curve[-1]
    start = [v for step, v in curve if step <= last_step * (1 - rule["window"])]
    return bool(start) and last < (1 - rule["relative_drop"]) * start[-1]


FLOOR_FACTOR, FLOOR_SLACK = 1.5, 0.01  # the protocol's "at_floor": RMSE <= 1.5 floor + 0.01


def at_floor(metric: float, floor: float) -> bool:
    """The protocol's test of an arm at its provable floor.

    >>> at_floor(0.104, 0.0627), at_floor(0.123, 0.0627), at_floor(0.009, 0.0)
    (True, False, True)
    """
    return metric <= FLOOR_FACTOR * floor + FLOOR_SLACK


class _Objective(nn.Module):
    """The interface :func:`trust_figures` reads: the network, its DEQ layers and the training objective."""

    deq_objective = "loss"

    def __init__(self, net: nn.Module, task: Task):
        super().__init__()
        self.net, self.task = net, task

    def deq_layers(self) -> list[DEQ]:
        return [m for m in self.net.modules() if isinstance(m, DEQ)]

    def loss_terms(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.task.loss(self.net, x)}


def splits(task: Task, protocol: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation and test samples (fixed generators, disjoint by seed)."""
    spec = protocol["construction"]["splits"]
    return tuple(task.sample(spec[k]["samples"], torch.Generator().manual_seed(spec[k]["seed"]))
                 for k in ("validation", "test"))


def train(task: Task, network: str, spend: Budget, seed: int, lr: float, protocol: dict,
          steps: int | None = None) -> dict:
    """One run: with ``steps`` that many; without, the selection rule's doubling from ``start_steps``. Its record:
    test and validation RMSE, the validation curve and its status, the floor and the diagnostics."""
    training = protocol["training"]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    net = build(network, task, spend, protocol)
    validation, test = splits(task, protocol)
    untrained = task.metric(net, test)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    objective = _Objective(net, task)
    layers = objective.deq_layers()
    target = steps or training["start_steps"]
    every = max(1, target // protocol["flattened"]["evaluations"])
    iters, capped_solves, curve, done, cpu = [], 0, [], 0, 0.0
    while True:
        tick = time.process_time()
        for _ in range(target - done):
            x = task.sample(training["batch"], gen)
            opt.zero_grad(set_to_none=True)
            task.loss(net, x).backward()
            opt.step()
            done += 1
            for layer in layers:
                iters.append(layer.stats.nstep)
                capped_solves += not layer.stats.converged
            if done % every == 0:
                curve.append((done, task.metric(net, validation)))
        cpu += time.process_time() - tick
        falling = still_falling(curve, protocol)
        if steps or not falling or target >= training["max_steps"]:
            break
        target = min(2 * target, training["max_steps"])
    metric = task.metric(net, test)
    floor = clipped_fit_floor(task.a, spend.lipschitz)
    record = {
        "lr": lr, "steps": done, "metric": metric, "validation": curve[-1][1], "curve": curve,
        "still_falling": falling, "floor": floor, "at_floor": at_floor(metric, floor),
        "metric_untrained": untrained, "metric_control": task.control(test),
        "largest_slope": largest_slope(net, test[:2048]), "lipschitz_budget": spend.lipschitz,
        "layer_cap": net.layer_cap, "lipschitz_cap": net.lipschitz_cap, "gamma": spend.gamma if layers else None,
        "phantom_steps": spend.phantom_steps if layers else None, "parameters": parameter_count(net),
        "cpu_ms_per_step": 1e3 * cpu / done, **weight_norms(net),
        "solver_iters": sum(iters) / len(iters) if iters else None,
        "capped_solves": capped_solves / len(iters) if iters else None,
    }
    if layers:
        record["trust"] = trust_figures(objective, task.sample(512, gen), seed=seed)
    return record


def chosen(selection: list[dict]) -> dict:
    """The selection run with the lowest final validation RMSE (ties: the first, i.e. the smallest lr).

    >>> chosen([{"lr": 1, "validation": 0.2}, {"lr": 2, "validation": 0.1}, {"lr": 3, "validation": 0.1}])["lr"]
    2
    """
    return min(selection, key=lambda r: r["validation"])
