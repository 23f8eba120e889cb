"""DEQ against constant-depth feed-forward networks under one weight-norm budget, on steep functions of one coordinate.

Run::

    python -m deqlab deq_vs_ffn                       # the protocol's runs (resumes; --shard 0/2 and 1/2
                                                              # split them between two processes)
    python -m deqlab deq_vs_ffn --report-only         # tables from the units on disk
    python -m deqlab deq_vs_ffn --steps 20 --seeds 2 --dims 2 --out /tmp/dvf   # a smoke run (off protocol)

Everything that decides the outcome (the construction, the budget, the networks, the training, the seeds, the rule
and the predictions) is in the committed protocol ``benchmarks/protocol/deq_vs_ffn/v2.json``; every unit records the
protocol's SHA-256, and options that depart from it are recorded and flagged on the page.

Two tasks in ``d`` dimensions, both steep along ``x_1`` with a slope ``a_d = 2 ** (d / 4)`` that grows
exponentially with ``d``: regression of ``tanh(a_d x_1)`` and score matching (SSM-VR) of
``p(x) ~ N(x; 0, I) sigmoid(k_d x_1)`` against its exact score. The networks: a DEQ
``z* = tanh(W z* + U x + b)``, ``y = V z* + c`` on deqscore's DEQ layer, and tanh networks of 2, 4 and 8 hidden
layers with the DEQ's parameter count. Every weight matrix's spectral norm is capped at ``B`` and the DEQ's ``W``
at ``gamma < 1`` (:func:`deqscore.deq.spectral_cap`), so the networks' Lipschitz constants are capped at
``B ** (L + 1)`` and ``B ** 2 / (1 - gamma)``.

Per unit (task x d x network x seed), in ``<out>/units/``: the held-out metric, the same at initialisation, the
largest slope ``d y / d x_1`` reached, the weight norms (spectral and largest entry), the solver's iterations and
capped solves, and for the DEQ its contraction at the fixed point and the phantom derivative's errors
(:func:`deqlab.study.trust.trust_figures`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from deqscore.deq import DEQ
from deqscore.metrics import parameter_count

from ..measure import environment, log
from ..report import Column, Table, table_markdown
from ..study.trust import trust_figures
from ..units import recorded
from .networks import FFN, DEQNet, Task, build, ffn_parameters, largest_slope, matched_width, slope, weight_norms
from .verdicts import comparisons, judge, outcome, summarise

__all__ = ["FFN", "DEQNet", "Task", "build", "comparisons", "ffn_parameters", "judge", "load_protocol", "main",
           "matched_width", "outcome", "run_unit", "slope", "summarise"]

PROTOCOL = Path("benchmarks/protocol/deq_vs_ffn/v2.json")
DEFAULT_OUT = "benchmarks/results/deq_vs_ffn"
TASKS = ("regression", "score")
CURVE_POINTS = 10  # held-out evaluations along training, for the flattened test


def load_protocol(path: Path = PROTOCOL) -> tuple[dict, str]:
    """The protocol and its SHA-256."""
    raw = path.read_bytes()
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


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


def run_unit(task: Task, network: str, seed: int, protocol: dict, steps: int) -> dict:
    """Train one network on one task with one seed; its record."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    net = build(network, task, protocol)
    training, evaluation = protocol["training"], protocol["evaluation"]
    held_out = task.sample(evaluation["samples"], torch.Generator().manual_seed(evaluation["seed"]))
    untrained = task.metric(net, held_out)
    opt = torch.optim.Adam(net.parameters(), lr=training["lr"])
    objective = _Objective(net, task)
    layers = objective.deq_layers()
    iters, capped_solves, curve, eval_seconds = [], 0, [], 0.0
    every = max(1, steps // CURVE_POINTS)
    start = time.perf_counter()
    for step in range(steps):
        if step % every == 0 and step:
            tick = time.perf_counter()
            curve.append((step, task.metric(net, held_out)))
            eval_seconds += time.perf_counter() - tick
        x = task.sample(training["batch"], gen)
        opt.zero_grad(set_to_none=True)
        value = task.loss(net, x)
        value.backward()
        opt.step()
        for layer in layers:
            iters.append(layer.stats.nstep)
            capped_solves += not layer.stats.converged
    seconds = time.perf_counter() - start - eval_seconds
    metric = task.metric(net, held_out)
    curve.append((steps, metric))
    record = {
        "metric": metric, "curve": curve, "still_falling": still_falling(curve, protocol),
        "metric_untrained": untrained, "metric_control": task.control(held_out), "final_loss": float(value.detach()),
        "largest_slope": largest_slope(net, held_out[:2048]), "lipschitz_cap": net.lipschitz_cap,
        "parameters": parameter_count(net), "ms_per_step": 1e3 * seconds / steps, **weight_norms(net),
        "solver_iters": sum(iters) / len(iters) if iters else None,
        "capped_solves": capped_solves / len(iters) if iters else None,
    }
    if layers:
        record["trust"] = trust_figures(objective, task.sample(512, gen), seed=seed)
    return record


def still_falling(curve: list[tuple[int, float]], protocol: dict) -> bool:
    """The protocol's test of an unfinished run: over the last ``window`` of the steps the held-out metric fell by
    more than ``relative_drop`` of its value at the window's start.

    >>> p = {"flattened": {"window": 0.2, "relative_drop": 0.05}}
    >>> still_falling([(80, 1.0), (100, 0.9)], p), still_falling([(80, 1.0), (100, 0.99)], p)
    (True, False)
    """
    rule = protocol["flattened"]
    last_step, last = curve[-1]
    start = [v for step, v in curve if step <= last_step * (1 - rule["window"])]
    return bool(start) and last < (1 - rule["relative_drop"]) * start[-1]


@dataclass(frozen=True)
class Unit:
    task: Task
    network: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.task.kind}_d{self.task.dim}_{self.network}_s{self.seed}"


def plan(args: argparse.Namespace, protocol: dict) -> list[Unit]:
    return [Unit(Task(kind, d, slope(d, protocol)), net, s) for kind in args.tasks for d in args.dims
            for net in args.networks for s in range(args.seeds)]


def run_all(args: argparse.Namespace, protocol: dict, sha: str) -> list[dict]:
    """Every unit of the plan (this process's shard of it), each recorded under ``<out>/units`` and read back if
    it was recorded with the same settings; with ``--report-only`` nothing is trained."""
    units, records = plan(args, protocol), []
    index, count = args.shard
    for i, unit in enumerate(units):
        path = Path(args.out) / "units" / f"{unit.name}.json"
        settings = {"unit": unit.name, "protocol_sha256": sha, "steps": args.steps}
        mine = i % count == index and not args.report_only
        if not mine:
            saved = json.loads(path.read_text()) if path.exists() else None
            if saved is None or saved["settings"] != settings:
                continue
            value = saved["value"]
        else:
            value = recorded(path, settings, lambda u=unit: run_unit(u.task, u.network, u.seed, protocol, args.steps),
                             device="cpu")
            log(f"{i + 1}/{len(units)} {unit.name}: metric {value['metric']:.4g} ({value['ms_per_step']:.1f} ms/step)")
        records.append({"task": unit.task.kind, "dim": unit.task.dim, "a": unit.task.a, "network": unit.network,
                        "seed": unit.seed, **value})
    return records


def tables(rows: list[dict], compared: list[dict], judged: list[dict], protocol: dict, off: dict) -> list[Table]:
    budget = protocol["budget"]
    main = Table("results", "Held-out metric (seed mean ± standard error) and diagnostics", [
        Column("task", "task"), Column("dim", "d"), Column("a", "slope a_d", ".3g"), Column("network", "network"),
        Column("seeds", "seeds"), Column("metric_cell", "metric"), Column("untrained_cell", "untrained"),
        Column("control", "trivial", ".3g"), Column("still_falling", "seeds still falling"),
        Column("slope_cell", "largest slope"), Column("lipschitz_cap", "Lipschitz cap", ".3g"),
        Column("parameters", "params"), Column("spectral", "max ||W||_2", ".3f"), Column("max_abs", "max |w|", ".2f"),
        Column("solver_iters", "solver iters", ".1f"), Column("capped_solves", "capped solves", ".3f"),
        Column("contraction", "contraction", ".3f"), Column("derivative_error", "phantom deriv. err.", ".2g"),
        Column("gradient_error", "grad. err. vs unrolled", ".2g"), Column("ms_per_step", "ms / step", ".1f"),
    ], rows, notes=[
        "metric: RMSE (regression) or Fisher divergence (score) on "
        f"{protocol['evaluation']['samples']} held-out exact samples; untrained: the same network at initialisation; "
        "trivial: predicting 0 (regression) or the Gaussian score -x (score).",
        f"Every weight matrix has spectral norm <= {budget['weight_spectral_bound']:g}, the DEQ's recurrent matrix <= "
        f"{budget['deq_contraction_bound']:g}; Lipschitz cap: B^(L+1) or B^2 / (1 - gamma); largest slope: "
        "max |d y_1 / d x_1| over 2048 held-out samples.",
        f"seeds still falling: held-out metric down by more than {protocol['flattened']['relative_drop']:.0%} over "
        f"the last {protocol['flattened']['window']:.0%} of the steps (the budget did not finish that run).",
        "DEQ diagnostics on the final weights (largest over seeds): contraction at the fixed point, the phantom "
        "steps' input-derivative error against the implicit derivative, the objective's parameter-gradient error "
        "against an unrolled solve, and the share of training solves that stopped at max_iter.",
        *([f"Off protocol: {off}."] if off else []),
    ])
    margin = protocol["rule"]["margin_log10"]
    comp = Table("comparisons", f"DEQ against each feed-forward network (log10 metric, margin {margin:g})", [
        Column("task", "task"), Column("dim", "d"), Column("ffn", "network"), Column("d", "FFN − DEQ", ".3f"),
        Column("se", "s.e.", ".3f"), Column("lower", "L", ".3f"), Column("upper", "U", ".3f"),
        Column("outcome", "outcome"), Column("seeds_needed", "seeds per arm for a decision"),
    ], compared, notes=["Positive: the DEQ's error is lower. deq_better: L > margin; ffn_better: U < -margin; "
                        "equivalent: both bounds within the margin; inconclusive otherwise.",
                        "Seeds per arm for a decision (inconclusive rows): those at which a DEQ truly equal to the "
                        "other network would be shown no worse than the margin (one side of the equivalence) with "
                        "80 % power at the measured spreads (deqlab.study.verdict.seeds_needed); '-' beyond "
                        "1000."])
    pred = Table("predictions", "Predictions, stated in the protocol before the runs", [
        Column("id", "id"), Column("text", "prediction"), Column("verdict", "verdict"), Column("detail", "outcomes"),
    ], judged)
    return [main, comp, pred]


def write(records: list[dict], args: argparse.Namespace, protocol: dict, sha: str) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(records)
    compared = comparisons(rows, protocol["rule"]["margin_log10"])
    judged = judge(protocol["predictions"], compared)
    off = off_protocol(args, protocol)
    all_tables = tables(rows, compared, judged, protocol, off)
    env = environment(torch.device("cpu"))
    doc = {"environment": env, "protocol": {"version": protocol["version"], "sha256": sha}, "units": len(records),
           "off_protocol": off, "sections": {t.name: t.as_dict() for t in all_tables}}
    md = ["# DEQ against constant-depth feed-forward networks on steep functions of one coordinate", ""]
    md += [f"* **{k}**: {v}" for k, v in env.items()]
    md += [f"* **protocol**: version {protocol['version']}, SHA-256 {sha[:12]}…; {len(records)} units", ""]
    md += [table_markdown(t) for t in all_tables]
    (out / "deq_vs_ffn.md").write_text("\n".join(md) + "\n")
    (out / "deq_vs_ffn.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def off_protocol(args: argparse.Namespace, protocol: dict) -> dict:
    """The options that depart from the protocol (a run with any is a smoke run, not the study)."""
    c = protocol["construction"]
    given = {"steps": args.steps, "seeds": args.seeds, "dims": args.dims, "tasks": list(args.tasks),
             "networks": list(args.networks)}
    wanted = {"steps": protocol["training"]["steps"], "seeds": protocol["seeds"], "dims": c["dims"],
              "tasks": list(TASKS), "networks": [k for k in protocol["networks"] if k != "deq_width"]}
    return {k: v for k, v in given.items() if v != wanted[k]}


def _list(kind: Callable[[str], object], choices: tuple | None = None) -> Callable[[str], list]:
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(",") if v]
        if choices is not None and (bad := [v for v in values if v not in choices]):
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(map(str, choices))}")
        return values
    return parse


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"--shard wants I/N with 0 <= I < N, got {text!r}")
    return int(index), int(count)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    protocol, _ = load_protocol()
    networks = tuple(k for k in protocol["networks"] if k != "deq_width")
    parser.add_argument("--tasks", type=_list(str, TASKS), default=list(TASKS))
    parser.add_argument("--dims", type=_list(int), default=protocol["construction"]["dims"])
    parser.add_argument("--networks", type=_list(str, networks), default=list(networks))
    parser.add_argument("--seeds", type=int, default=protocol["seeds"])
    parser.add_argument("--steps", type=int, default=protocol["training"]["steps"])
    parser.add_argument("--shard", type=_shard, default=(0, 1), help="I/N: run every N-th unit from the I-th")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--report-only", action="store_true", help="tables from the units on disk; train nothing")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The protocol's units ``args`` selects (resumed from those on disk) and their report."""
    protocol, sha = load_protocol()
    torch.set_num_threads(args.threads)
    records = run_all(args, protocol, sha)
    return write(records, args, protocol, sha)
