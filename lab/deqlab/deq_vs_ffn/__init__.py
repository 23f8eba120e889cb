"""DEQ against feed-forward networks under one Lipschitz budget per comparison, on a steep function of one
coordinate, every network trained to its floor (protocol v3).

Run::

    python -m deqlab deq_vs_ffn                       # the protocol's units, in its order (resumes)
    python -m deqlab deq_vs_ffn --report-only         # the page from the units on disk
    python -m deqlab deq_vs_ffn --only control:2:deq,control:2:ffn2 --seeds 2 --max-steps 40 --out /tmp/dvf

Everything that decides the outcome (construction, budgets, networks, the lr and steps selection rule, the floor
test, seeds, rule and predictions) is in the committed protocol ``benchmarks/protocol/deq_vs_ffn/v3.json``; every
unit records its SHA-256, and options that depart from it are recorded and flagged on the page.

Regression of ``tanh(a_d x_1)``, ``x ~ N(0, I_d)``, ``a_d = 2 ** (d / 4)``. Per comparison one Lipschitz budget
``Lambda = B^2 / (1 - gamma)``, the DEQ's: a feed-forward network of ``L`` hidden layers has every matrix capped at
``Lambda^(1/(L+1))``. The control DEQ has ``gamma = 0.9``; the steepening DEQ ``gamma_d -> 1`` with its weights'
norms fixed. Per architecture the lr and step count are chosen on a validation split
(:mod:`.training`); each arm is compared with its provable floor (:func:`.networks.clipped_fit_floor`), and an arm
still falling or far above it decides no verdict (:mod:`.verdicts`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..measure import environment, log
from ..report import Column, Result, Table, write_result
from ..units import recorded
from .networks import (
    FFN,
    Budget,
    DEQNet,
    Task,
    budget,
    build,
    clipped_fit_floor,
    ffn_parameters,
    matched_width,
    slope,
    weight_norms,
)
from .training import chosen, still_falling, train
from .verdicts import comparisons, judge, outcome, summarise_arm

__all__ = ["FFN", "Budget", "DEQNet", "Task", "budget", "build", "clipped_fit_floor", "comparisons",
           "ffn_parameters", "judge", "load_protocol", "main", "matched_width", "outcome", "plan", "slope",
           "still_falling", "weight_norms"]

PROTOCOL = Path("benchmarks/protocol/deq_vs_ffn/v3.json")
TITLE = "DEQ against feed-forward networks under one Lipschitz budget, each trained to its floor"
DEFAULT_OUT = "benchmarks/results/deq_vs_ffn"
# The protocol's "order": the predictions' arms first, the costly steepening DEQ at d = 32 after the cheap ones.
ORDER = [("control", 32, "deq"), ("control", 32, "ffn2"), ("control", 32, "ffn8"), ("control", 2, "deq"),
         ("control", 2, "ffn2"), ("control", 2, "ffn8"), ("steep", 32, "ffn2"), ("steep", 32, "deq_steep"),
         ("control", 32, "ffn54"), ("control", 16, "deq"), ("control", 16, "ffn2"), ("control", 16, "ffn8"),
         ("steep", 24, "deq_steep"), ("steep", 24, "ffn2"), ("steep", 24, "ffn8"), ("steep", 32, "ffn8")]


def load_protocol(path: Path = PROTOCOL) -> tuple[dict, str]:
    """The protocol and its SHA-256."""
    raw = path.read_bytes()
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def plan(protocol: dict) -> list[tuple[str, int, str]]:
    """The protocol's arms (budget, d, network) in its order; a test fails if ORDER and the arms disagree."""
    arms = {(a["budget"], d, n) for a in protocol["arms"] for d in a["dims"] for n in a["networks"]}
    return [arm for arm in ORDER if arm in arms]


def run_arm(arm: tuple[str, int, str], args: argparse.Namespace, protocol: dict, sha: str) -> list[dict] | None:
    """The arm's test runs (one per seed) by the selection rule, each recorded under ``<out>/units``; with
    ``--report-only`` those on disk (None while its selection is incomplete)."""
    kind, dim, network = arm
    task = Task("regression", dim, slope(dim, protocol))
    spend = budget(kind, task.a, protocol)
    training = {**protocol["training"], **args.overrides}
    proto = {**protocol, "training": training}
    stem = f"regression_d{dim}_{network}_{kind}"

    def unit(name: str, settings: dict, compute: Callable[[], dict]) -> dict | None:
        path = Path(args.out) / "units" / f"{name}.json"
        settings = json.loads(json.dumps({"unit": name, "protocol_sha256": sha, **args.overrides, **settings}))
        if args.report_only:
            saved = json.loads(path.read_text()) if path.exists() else None
            return saved["value"] if saved and saved["settings"] == settings else None
        value = recorded(path, settings, compute, device="cpu")
        log(f"{name}: RMSE {value['metric']:.4g} at {value['steps']} steps, lr {value['lr']:g} "
            f"({value['cpu_ms_per_step']:.1f} CPU ms/step)")
        return value

    selection = [unit(f"{stem}_lr{lr:g}_s0", {"lr": lr},
                      lambda lr=lr: train(task, network, spend, 0, lr, proto)) for lr in training["lr_grid"]]
    if None in selection:
        return None
    best = chosen(selection)
    runs = [best] + [unit(f"{stem}_s{seed}", {"lr": best["lr"], "steps": best["steps"]},
                          lambda s=seed: train(task, network, spend, s, best["lr"], proto, steps=best["steps"]))
                     for seed in range(1, args.seeds)]
    return [r for r in runs if r is not None]  # under --report-only, the seeds recorded so far


COLUMNS = [
    Column("dim", "d"), Column("a", "slope a_d", ".3g"), Column("budget", "budget"), Column("network", "network"),
    Column("seeds", "seeds"), Column("metric_cell", "test RMSE"), Column("floor", "floor", ".3g"),
    Column("above_floor", "RMSE / floor", ".2f"), Column("at_floor", "at floor"),
    Column("still_falling", "seeds still falling"), Column("status", "decides"), Column("lr", "lr", "g"),
    Column("steps", "steps"), Column("untrained", "untrained", ".3g"), Column("control", "trivial", ".3g"),
    Column("lipschitz_budget", "Lipschitz budget", ".4g"), Column("layer_cap", "per-layer cap", ".3f"),
    Column("spectral_product", "trained bound", ".4g"), Column("max_spectral", "max ||W||_2", ".3f"),
    Column("slope_cell", "largest slope"), Column("parameters", "params"), Column("gamma", "gamma", ".6g"),
    Column("phantom_steps", "phantom K"), Column("solver_iters", "solver iters", ".1f"),
    Column("capped_solves", "capped solves", ".3f"), Column("contraction", "contraction", ".3f"),
    Column("derivative_error", "phantom deriv. err.", ".2g"), Column("gradient_error", "grad. err.", ".2g"),
    Column("cpu_ms_per_step", "CPU ms / step (with validation)", ".1f"),
]


def tables(arms: list[dict], compared: list[dict], judged: list[dict], protocol: dict, missing: list,
           off: dict) -> list[Table]:
    want = protocol["seeds"]
    for arm in arms:
        arm["status"] = ("no: " + ", ".join(w for w, bad in [("still falling", arm["still_falling"]),
                                                            ("far above floor", not arm["at_floor"])] if bad)
                         if arm["marked"] else "yes") + ("" if arm["seeds"] >= want else f" (interim: {arm['seeds']}"
                                                         f" of {want} seeds)")
    main = Table("arms", "Every arm: test RMSE (seed mean ± standard error), its floor, its curve, its budget", COLUMNS,
                 arms, notes=[
        "floor: the least RMSE any network within the arm's Lipschitz budget can reach, that of the clipped fit "
        "sign(x_1) min(budget |x_1|, tanh(a_d |x_1|)); at floor: RMSE <= 1.5 floor + 0.01. decides: 'no' for an "
        "arm with a seed still falling (validation RMSE down > 5 % over the last 20 % of steps) or far above its "
        "floor; such an arm decides no comparison.",
        "budget: control (the DEQ's gamma = 0.9, Lipschitz 40) or steep (gamma_d = max(0.9, 1 - 4 / (2 a_d)), "
        "Lipschitz max(40, 2 a_d)); every network of a comparison shares it: a feed-forward network's per-layer "
        "cap is budget^(1 / (L + 1)). trained bound: the product of the trained weights' spectral norms "
        "(the DEQ's ||U|| ||V|| / (1 - ||W||)). lr and steps: chosen on the validation split (seed 0).",
        "untrained: the network at initialisation; trivial: predicting 0. DEQ diagnostics on the final weights "
        "(largest over seeds): contraction at the fixed point, the phantom derivative's error against the "
        "implicit one, the parameter-gradient error against an unrolled solve.",
        *([f"Not yet run (or selection incomplete): {', '.join(f'{b} d={d} {n}' for b, d, n in missing)}."]
          if missing else []),
        *([f"Off protocol: {off}."] if off else []),
    ])
    steep = [a for a in arms if a["network"].startswith("deq")]
    norms = Table("deq_norms", "The DEQs' weights against d (seed means; max norms: largest over seeds)", [
        Column("dim", "d"), Column("budget", "budget"), Column("gamma", "gamma cap", ".6g"),
        Column("recurrent_norm", "||W||_2", ".4f"), Column("max_spectral", "max ||U||, ||V||, ||W||", ".3f"),
        Column("spectral_product", "||U|| ||V|| / (1 - ||W||)", ".4g"), Column("max_abs", "max |w|", ".3f"),
        Column("slope_cell", "largest slope"), Column("phantom_steps", "phantom K"),
        Column("solver_iters", "solver iters", ".1f"),
    ], sorted(steep, key=lambda a: (a["budget"], a["dim"])))
    margin = protocol["rule"]["margin_log10"]
    comp = Table("comparisons", f"Arm A against arm B (log10 test RMSE, margin {margin:g})", [
        Column("dim", "d"), Column("a", "A"), Column("b", "B"), Column("d", "B − A", ".3f"),
        Column("se", "s.e.", ".3f"),
        Column("lower", "L", ".3f"), Column("upper", "U", ".3f"), Column("outcome", "outcome"),
        Column("decides", "decides"), Column("seeds_needed", "seeds per arm for a decision"),
    ], compared, notes=["Positive: A's error is lower. a_better: L > margin; b_better: U < -margin; equivalent: both "
                        "bounds within the margin; inconclusive otherwise. decides: both arms unmarked."])
    pred = Table("predictions", "Predictions, stated in the protocol before the runs", [
        Column("id", "id"), Column("text", "prediction"), Column("expected", "expected"),
        Column("verdict", "verdict"), Column("detail", "outcomes"),
    ], judged, notes=["borne out: every named comparison decides with an expected outcome; contradicted: one "
                      "decides with another; open: otherwise (an inconclusive or undecided comparison is never "
                      "borne out)."])
    return [pred, main, norms, comp]


def write(arms: list[dict], missing: list, args: argparse.Namespace, protocol: dict, sha: str) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    margin = protocol["rule"]["margin_log10"]
    compared = comparisons(arms, margin)
    judged = judge(protocol["predictions"], arms, margin)
    off = off_protocol(args, protocol)
    all_tables = tables(arms, compared, judged, protocol, missing, off)
    header = {**environment(torch.device("cpu")),
              "protocol": f"version {protocol['version']}, SHA-256 {sha[:12]}…; {len(arms)} of {len(plan(protocol))} "
                          "arms with units" + (" (interim: the rest not yet run)" if missing else "")}
    settings = {"protocol": {"version": protocol["version"], "sha256": sha}, "arms": len(arms), "missing": missing,
                "off_protocol": off}
    return write_result(out, "deq_vs_ffn", Result(TITLE, header, settings, all_tables))


def off_protocol(args: argparse.Namespace, protocol: dict) -> dict:
    """The options that depart from the protocol (a run with any is a smoke run, not the study)."""
    off = dict(args.overrides)
    if args.seeds != protocol["seeds"]:
        off["seeds"] = args.seeds
    if args.only:
        off["only"] = [":".join(map(str, a)) for a in args.only]
    return off


def _arm(text: str) -> tuple[str, int, str]:
    kind, _, rest = text.partition(":")
    dim, _, network = rest.partition(":")
    if not dim.isdigit() or not network:
        raise argparse.ArgumentTypeError(f"--only wants budget:d:network, got {text!r}")
    return kind, int(dim), network


def add_arguments(parser: argparse.ArgumentParser) -> None:
    protocol, _ = load_protocol()
    parser.add_argument("--only", type=lambda t: [_arm(v) for v in t.split(",") if v], default=None,
                        help="budget:d:network,...: these arms of the protocol only")
    parser.add_argument("--seeds", type=int, default=protocol["seeds"])
    parser.add_argument("--start-steps", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--lrs", type=lambda t: [float(v) for v in t.split(",") if v], default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--report-only", action="store_true", help="the page from the units on disk; train nothing")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The protocol's units ``args`` selects (resumed from those on disk) and their report."""
    protocol, sha = load_protocol()
    torch.set_num_threads(args.threads)
    if args.only and (bad := [a for a in args.only if a not in plan(protocol)]):
        parser.error(f"--only: {bad[0]} is not an arm of the protocol")
    given = {"start_steps": args.start_steps, "max_steps": args.max_steps, "lr_grid": args.lrs}
    args.overrides = {k: v for k, v in given.items() if v is not None and v != protocol["training"][k]}
    if args.overrides.get("start_steps", 1) < 1 or args.overrides.get("max_steps", 1) < 1 or args.seeds < 1:
        parser.error("--start-steps, --max-steps and --seeds want positive counts")
    arms, missing = [], []
    for arm in args.only or plan(protocol):
        runs = run_arm(arm, args, protocol, sha)
        if runs:
            arms.append({"a": slope(arm[1], protocol), **summarise_arm(*arm, runs)})
        else:
            missing.append(arm)
    if not args.report_only:
        log(f"{len(arms)} arms done")
    return write(arms, missing, args, protocol, sha)
