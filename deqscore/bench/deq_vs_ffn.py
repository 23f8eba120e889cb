"""DEQ against constant-depth feed-forward networks under one weight-norm budget, on steep functions of one coordinate.

Run::

    python -m deqscore.bench.deq_vs_ffn                       # the protocol's runs (resumes; --shard 0/2 and 1/2
                                                              # split them between two processes)
    python -m deqscore.bench.deq_vs_ffn --report-only         # tables from the units on disk
    python -m deqscore.bench.deq_vs_ffn --steps 20 --seeds 2 --dims 2 --out /tmp/dvf   # a smoke run (off protocol)

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
(:func:`deqscore.bench.study.trust.trust_figures`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..deq import DEQ, spectral_cap
from ..losses import sliced_score_matching
from ..metrics import parameter_count
from .measure import environment, log
from .report import Column, Table, fmt_value, table_markdown
from .study.trust import trust_figures
from .study.verdict import non_inferiority
from .units import mean_stderr, recorded

Tensor = torch.Tensor
PROTOCOL = Path("benchmarks/protocol/deq_vs_ffn/v2.json")
DEFAULT_OUT = "benchmarks/results/deq_vs_ffn"
TASKS = ("regression", "score")
CURVE_POINTS = 10  # held-out evaluations along training, for the flattened test


def load_protocol(path: Path = PROTOCOL) -> tuple[dict, str]:
    """The protocol and its SHA-256."""
    raw = path.read_bytes()
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def slope(dim: int, protocol: dict) -> float:
    """``a_d``: the steepness of both tasks along ``x_1`` at dimension ``d``."""
    c = protocol["construction"]
    return c["slope_base"] ** (dim / c["slope_dims_per_doubling"])


@dataclass(frozen=True)
class Task:
    """A steep task in ``dim`` dimensions: exact samples, the metric, the training loss."""

    kind: str  # "regression" or "score"
    dim: int
    a: float  # the slope along x_1

    @property
    def k(self) -> float:
        """The score task's sigmoid steepness: the exact score's x_1 part has slope ``1 + k^2 / 4 = 1 + a``."""
        return 2.0 * math.sqrt(self.a)

    @property
    def out_dim(self) -> int:
        return 1 if self.kind == "regression" else self.dim

    def sample(self, n: int, gen: torch.Generator) -> Tensor:
        if self.kind == "regression":
            return torch.randn(n, self.dim, generator=gen)
        out, have = [], 0  # N(0, I) proposals accepted with probability sigmoid(k x_1) (rate 1/2)
        while have < n:
            x = torch.randn(3 * n, self.dim, generator=gen)
            keep = torch.rand(3 * n, generator=gen) < torch.sigmoid(self.k * x[:, 0])
            out.append(x[keep])
            have += int(keep.sum())
        return torch.cat(out)[:n]

    def target(self, x: Tensor) -> Tensor:
        """The regression target ``tanh(a x_1)``, or the exact score ``-x + e_1 k sigmoid(-k x_1)``."""
        if self.kind == "regression":
            return torch.tanh(self.a * x[:, :1])
        s = -x.clone()
        s[:, 0] += self.k * torch.sigmoid(-self.k * x[:, 0])
        return s

    def loss(self, net: nn.Module, x: Tensor) -> Tensor:
        if self.kind == "regression":
            return (net(x) - self.target(x)).pow(2).mean()
        return sliced_score_matching(net, x, variance_reduction=True).mean()

    def control(self, x: Tensor) -> float:
        """The metric of the trivial answer: 0 for the regression, the Gaussian score ``-x`` for the score."""
        return self.metric(lambda x: torch.zeros(len(x), 1) if self.kind == "regression" else -x, x)

    def metric(self, net: Callable[[Tensor], Tensor], x: Tensor) -> float:
        """Held-out RMSE (regression) or Fisher divergence ``E ||s - grad log p||^2`` (score)."""
        with torch.no_grad():
            err = (net(x) - self.target(x)).pow(2).sum(1).mean()
        return float(err.sqrt() if self.kind == "regression" else err)


def capped(lin: nn.Linear, bound: float) -> nn.Linear:
    return spectral_cap(lin, bound)


class TanhMap(nn.Module):
    """``f(z, u) = tanh(W z + u)`` with ``||W||_2 <= gamma``: a gamma-contraction in ``z``."""

    def __init__(self, width: int, gamma: float):
        super().__init__()
        self.lin = capped(nn.Linear(width, width, bias=False), gamma)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return torch.tanh(self.lin(z) + u)


class DEQNet(nn.Module):
    """``y = V z* + c``, ``z* = tanh(W z* + U x + b)``; ``||U||, ||V|| <= B``, ``||W|| <= gamma``."""

    def __init__(self, dim: int, out_dim: int, width: int, bound: float, gamma: float, deq: dict):
        super().__init__()
        self.inp = capped(nn.Linear(dim, width), bound)
        self.deq = DEQ(TanhMap(width, gamma), warn_on_nonconvergence=False, **deq)
        self.out = capped(nn.Linear(width, out_dim), bound)
        self.lipschitz_cap = bound**2 / (1.0 - gamma)

    def forward(self, x: Tensor) -> Tensor:
        # One singular value decomposition per weight per forward, not per solver iteration. The cache is filled
        # here, with autograd on: filled inside the solve's no_grad, the phantom steps would reuse a weight that
        # carries no gradient and W would never train.
        with parametrize.cached():
            _ = self.deq.func.lin.weight
            return self.out(self.deq(self.inp(x)))


class FFN(nn.Module):
    """``depth`` tanh hidden layers of ``width``; every matrix's spectral norm at most ``B``."""

    def __init__(self, dim: int, out_dim: int, width: int, depth: int, bound: float):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [capped(nn.Linear(dim if i == 0 else width, width), bound), nn.Tanh()]
        self.body = nn.Sequential(*layers, capped(nn.Linear(width, out_dim), bound))
        self.lipschitz_cap = bound ** (depth + 1)

    def forward(self, x: Tensor) -> Tensor:
        with parametrize.cached():
            return self.body(x)


def ffn_parameters(dim: int, out_dim: int, width: int, depth: int) -> int:
    """Parameters of :class:`FFN`."""
    return dim * width + width + (depth - 1) * (width * width + width) + width * out_dim + out_dim


def matched_width(dim: int, out_dim: int, depth: int, target: int) -> int:
    """The FFN width whose parameter count is closest to ``target``.

    >>> matched_width(2, 1, 2, ffn_parameters(2, 1, 40, 2))
    40
    """
    return min(range(1, 4 * int(math.sqrt(target)) + 8),
               key=lambda w: abs(ffn_parameters(dim, out_dim, w, depth) - target))


def build(network: str, task: Task, protocol: dict) -> nn.Module:
    """``"deq"`` or ``"ffn<depth>"`` (the latter matched to the DEQ's parameter count)."""
    budget, width = protocol["budget"], protocol["networks"]["deq_width"]
    bound, gamma = budget["weight_spectral_bound"], budget["deq_contraction_bound"]
    deq = DEQNet(task.dim, task.out_dim, width, bound, gamma, protocol["deq"])
    if network == "deq":
        return deq
    depth = int(network[3:])
    width = matched_width(task.dim, task.out_dim, depth, parameter_count(deq))
    return FFN(task.dim, task.out_dim, width, depth, bound)


def weight_norms(net: nn.Module) -> dict[str, float]:
    """The largest spectral norm and the largest entry over the (capped) weight matrices."""
    weights = [m.weight.detach() for m in net.modules() if isinstance(m, nn.Linear)]
    return {"max_spectral_norm": max(float(torch.linalg.matrix_norm(w, ord=2)) for w in weights),
            "max_abs_weight": max(float(w.abs().max()) for w in weights)}


def largest_slope(net: nn.Module, x: Tensor) -> float:
    """``max |d y_1 / d x_1|`` over the samples (``y_1``: the output, or the score's x_1 part)."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(net(x)[:, 0].sum(), x)
    return float(g[:, 0].abs().max())


class _Objective(nn.Module):
    """The interface :func:`trust_figures` reads: the network, its DEQ layers and the training objective."""

    deq_objective = "loss"

    def __init__(self, net: nn.Module, task: Task):
        super().__init__()
        self.net, self.task = net, task

    def deq_layers(self) -> list[DEQ]:
        return [m for m in self.net.modules() if isinstance(m, DEQ)]

    def loss_terms(self, x: Tensor) -> dict[str, Tensor]:
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
    layers = _Objective(net, task).deq_layers()
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
        record["trust"] = trust_figures(_Objective(net, task), task.sample(512, gen), seed=seed)
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


def _mean_cell(values: list[float], spec: str = ".3g") -> str:
    mean, se = mean_stderr(values)
    return fmt_value(mean, spec) + (f" ± {fmt_value(se, '.2g')}" if se is not None else "")


def summarise(records: list[dict]) -> list[dict]:
    """One row per (task, d, network): seed means and standard errors of the metric and the diagnostics."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r["dim"], r["network"]), []).append(r)
    rows = []
    for (task, dim, network), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], _depth(kv[0][2]))):
        trust = [r["trust"] for r in rs if r.get("trust")]
        rows.append({
            "task": task, "dim": dim, "a": rs[0]["a"], "network": network, "seeds": len(rs),
            "log10_metric": [math.log10(r["metric"]) for r in rs],
            "metric_cell": _mean_cell([r["metric"] for r in rs]),
            "untrained_cell": _mean_cell([r["metric_untrained"] for r in rs]), "control": rs[0]["metric_control"],
            "still_falling": sum(r["still_falling"] for r in rs),
            "slope_cell": _mean_cell([r["largest_slope"] for r in rs]), "lipschitz_cap": rs[0]["lipschitz_cap"],
            "parameters": rs[0]["parameters"], "spectral": max(r["max_spectral_norm"] for r in rs),
            "max_abs": max(r["max_abs_weight"] for r in rs),
            "ms_per_step": mean_stderr([r["ms_per_step"] for r in rs])[0],
            "solver_iters": mean_stderr([r["solver_iters"] for r in rs])[0] if rs[0]["solver_iters"] else None,
            "capped_solves": max(r["capped_solves"] for r in rs) if rs[0]["capped_solves"] is not None else None,
            "contraction": max(t["contraction"] for t in trust) if trust else None,
            "derivative_error": max(t["derivative_rel_error"] for t in trust) if trust else None,
            "gradient_error": max(t["gradient_rel_error"] for t in trust) if trust else None,
        })
    return rows


def _depth(network: str) -> int:
    return 0 if network == "deq" else int(network[3:])


def outcome(deq: list[float], ffn: list[float], margin: float) -> dict | None:
    """The rule of the protocol on log10 metrics (lower is better): ``d`` = FFN minus DEQ, one-sided 95 % bounds
    L and U, and the outcome ``deq_better`` / ``ffn_better`` / ``equivalent`` / ``inconclusive``.

    >>> outcome([0.0, 0.01, -0.01], [1.0, 1.01, 0.99], 0.1)["outcome"]
    'deq_better'
    >>> outcome([0.0, 0.01, -0.01], [0.0, 0.02, -0.01], 0.1)["outcome"]
    'equivalent'
    """
    test = non_inferiority(deq, ffn, margin, higher_is_better=False)
    if test is None:
        return None
    lower, upper = test.lower, test.upper
    result = ("deq_better" if lower > margin else "ffn_better" if upper < -margin
              else "equivalent" if lower > -margin and upper < margin else "inconclusive")
    return {"d": test.d, "se": test.se, "df": test.df, "lower": lower, "upper": upper, "outcome": result,
            "seeds": test.n}


def comparisons(rows: list[dict], margin: float) -> list[dict]:
    """The DEQ against every feed-forward network, per (task, d)."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["task"], r["dim"]), {})[r["network"]] = r
    out = []
    for (task, dim), nets in sorted(by_key.items()):
        if "deq" not in nets:
            continue
        for network, row in sorted(nets.items(), key=lambda kv: _depth(kv[0])):
            if network != "deq" and (res := outcome(nets["deq"]["log10_metric"], row["log10_metric"], margin)):
                out.append({"task": task, "dim": dim, "a": row["a"], "ffn": network, **res})
    return out


def judge(predictions: list[dict], compared: list[dict]) -> list[dict]:
    """Each prediction against the comparisons it names: borne out, contradicted (an outcome other than the
    expected one and not inconclusive) or open (some inconclusive or not yet run)."""
    rows = []
    for p in predictions:
        hits = [c for c in compared if p["task"] in ("*", c["task"]) and c["dim"] == p["dim"]
                and p["ffn"] in ("*", c["ffn"])]
        negated = p["expected"].startswith("not ")
        want = p["expected"].removeprefix("not ")
        ok = [(c["outcome"] != want) if negated else (c["outcome"] == want) for c in hits]
        verdict = ("not run" if not hits else "borne out" if all(ok)
                   else "open" if all(o or c["outcome"] == "inconclusive" for o, c in zip(ok, hits, strict=True))
                   else "contradicted")
        detail = "; ".join(f"{c['task']} vs {c['ffn']}: {c['outcome']}" for c in hits)
        rows.append({"id": p["id"], "text": p["text"], "verdict": verdict, "detail": detail})
    return rows


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
        Column("outcome", "outcome"),
    ], compared, notes=["Positive: the DEQ's error is lower. deq_better: L > margin; ffn_better: U < -margin; "
                        "equivalent: both bounds within the margin; inconclusive otherwise."])
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


def parse(argv: list[str] | None) -> argparse.Namespace:
    protocol, _ = load_protocol()
    networks = tuple(k for k in protocol["networks"] if k != "deq_width")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=_list(str, TASKS), default=list(TASKS))
    parser.add_argument("--dims", type=_list(int), default=protocol["construction"]["dims"])
    parser.add_argument("--networks", type=_list(str, networks), default=list(networks))
    parser.add_argument("--seeds", type=int, default=protocol["seeds"])
    parser.add_argument("--steps", type=int, default=protocol["training"]["steps"])
    parser.add_argument("--shard", type=_shard, default=(0, 1), help="I/N: run every N-th unit from the I-th")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--report-only", action="store_true", help="tables from the units on disk; train nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    protocol, sha = load_protocol()
    torch.set_num_threads(args.threads)
    records = run_all(args, protocol, sha)
    return write(records, args, protocol, sha)


if __name__ == "__main__":
    main()
