"""The study page's per-unit tables: the DEQs' trust figures, every run with its provenance (protocol, code
commit, thread count, torch, device, start and end), the run-to-run spread from recorded reruns, and the sample
grids. :mod:`.report` places them in each family's section."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from ..report import pipe_table
from .core import Family, Metric, holding_commit, last_logged, recorded_files, rerun_path, value_of, without_protocol
from .judging import exclusion
from .protocol import Protocol
from .tuning import rate_of_best_runs


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1e4 or (value != 0 and abs(value) < 10 ** -digits):
        return f"{value:.{digits}g}"
    return f"{value:,.{digits}f}"


def trust_table(units: list[dict], rules: Protocol) -> list[str]:
    """Mean over seeds of each DEQ variant's trust figures; a variant whose training gradient is further from the
    exact one than the protocol allows is marked, and one with no converged reference is unverified
    (:func:`faithful_cell`). Figures a unit did not record (units before v4: the stable
    objective scale, the gradient's cosine and norm ratio, the reference solve's residual) show as –."""
    threshold = rules.text["trust"]["faithful_below"]
    runs = [u for u in units if u["value"].get("trust")]
    if not runs:
        return []
    lines = ["**Trust figures** (final weights, first test batch; mean over seeds, max over seeds in brackets; the "
             "objective's error against the root mean square of its per-sample terms):", ""]
    header = ["data", "variant", "seeds", "contraction", "K", "contraction^K", "derivative error", "objective error",
              "gradient error", "gradient cosine", "gradient norm ratio", "capped solves (test / training)",
              "reference solve", "faithful"]
    rows = []
    for group, name in dict.fromkeys((u["group"], u["variant"]) for u in runs):
        arm = [u for u in runs if (u["group"], u["variant"]) == (group, name)]
        figures = [u["value"]["trust"] for u in arm]
        cell = functools.partial(trust_cell, figures)
        phantom = backward_of(arm[0]) == "phantom"  # K steps and their Neumann remainder: the phantom backward's
        rows.append([group, name, str(len(figures)), cell("contraction"),
                     str(figures[0]["phantom_steps"]) if phantom else backward_of(arm[0]),
                     cell("neumann_remainder") if phantom else "–", cell("derivative_rel_error", True),
                     cell("objective_error_scaled", True), cell("gradient_rel_error", True),
                     cell("gradient_cosine"), cell("gradient_norm_ratio"),
                     f"{cell('capped_solves', True)} / {cell('capped_solves_training', True)}",
                     reference_solve(figures), faithful_cell(figures, threshold)])
    return [*lines, *pipe_table(header, rows), ""]


def faithful_cell(figures: list[dict], threshold: float) -> str:
    """Whether an arm trains on its own gradient: no where a seed's gradient error reaches the protocol's
    threshold; unverified where a seed's reference solve neither converged nor stalled at float32's floor (its error
    is then measured against no exact gradient: a map that does not contract at its fixed point has no converging
    reference); yes otherwise."""
    if max(f["gradient_rel_error"] for f in figures) >= threshold:
        return f"**no** (> {threshold:.0%})"
    if any(not f["exact_converged"] and not f.get("exact_at_floor") for f in figures):
        return "**unverified** (a reference solve did not converge: no exact gradient to measure against)"
    return "yes"


def reference_solve(figures: list[dict]) -> str:
    """How the reference solves ended: converged, at float32's floor (the residual stalled at the precision's limit,
    which is as converged as float32 allows), or unconverged; and how many were the implicit derivative, which
    replaces the unrolled solve where that diverges (:func:`deqlab.study.trust.trust_figures`)."""
    converged = sum(bool(f["exact_converged"]) for f in figures)
    floor = sum(not f["exact_converged"] and bool(f.get("exact_at_floor")) for f in figures)
    parts = [f"{converged} of {len(figures)} converged"]
    implicit = sum(f.get("exact_reference") == "implicit" for f in figures)
    if implicit:
        parts.append(f"{implicit} by the implicit derivative (the unrolled solve diverged)")
    if floor:
        parts.append(f"{floor} at float32's floor")
    unknown = sum(not f["exact_converged"] and "exact_at_floor" not in f for f in figures)
    if unknown:
        parts.append(f"{unknown} unconverged or at float32's floor (residual not recorded)")
    return ", ".join(parts)


def trust_cell(figures: list[dict], key: str, percent: bool = False) -> str:
    """Mean over runs of one trust figure, the largest in brackets."""
    values = [f[key] for f in figures if f.get(key) is not None]
    if not values:
        return "–"
    show = percent_text if percent else fmt
    return f"{show(sum(values) / len(values))} ({show(max(values))})"


def percent_text(value: float) -> str:
    """A share as a percentage: one decimal, or one significant digit below 0.1 % (an exact backward's error is
    millionths, which 0.0 % would hide)."""
    return f"{value:.1%}" if value == 0 or abs(value) >= 1e-3 else f"{value * 100:.1g}%"


def backward_of(unit: dict) -> str:
    """How a DEQ unit's training differentiated through its layers: ``implicit`` or ``phantom``."""
    trust = unit["value"].get("trust") or {}
    if "backward" in trust:
        return trust["backward"]
    implicit = any(a.endswith("backward=implicit") for a in unit["value"].get("arguments", []))
    return "implicit" if implicit else "phantom"


def code_label(code: dict | None, changes: str = "+") -> str:
    """A unit's code: its commit, with ``changes`` where the checkout had uncommitted changes, and the later
    commit that holds exactly those changes where one does (:func:`.core.holding_commit`)."""
    if code is None:
        return "not recorded"
    text = f"`{code['commit'][:10]}`"
    if code["uncommitted_changes"]:
        later = holding_commit(code)
        text += changes + (f" (= `{later[:10]}`)" if later else "")
    return text


def provenance(unit: dict) -> list[str]:
    """Protocol, code, threads, torch, start and hours of one unit ('–' where the unit predates the record); a
    unit that continued a stopped run says from which step (its start and hours are those of the launch that
    finished it)."""
    commit = "–" if unit.get("code") is None else code_label(unit["code"])
    start, end = unit.get("started"), unit.get("ended")
    hours = "–"
    if start and end:
        hours = f"{(datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds() / 3600:.2f}"
    if (resumed := unit["value"].get("resumed_at_step")) is not None:
        hours += f" (resumed at step {resumed:,})"
    return [f"v{unit['settings']['protocol']['version']}", commit, str(unit.get("threads", "–")),
            unit.get("torch", "–"), unit["device"], start[:16].replace("T", " ") if start else "–", hours]


def per_run_table(family: Family, units: list[dict], rules: Protocol) -> list[str]:
    """Every run: its metrics (with their own standard error where the run records one), solver facts, whether it
    counts, and its provenance."""
    keys = [m.key for m in family.metrics]
    header = ["data", "variant", "seed", *keys, "solver iterations", "gradient error", "counted", "protocol",
              "commit (+: uncommitted changes; =: the commit that holds them)", "threads", "torch", "device",
              "started (UTC)", "hours"]
    rows, errors = [], False
    for u in units:
        spreads = [spread(u, k) for k in keys]
        errors = errors or any(spreads)
        cells = [fmt(value_of(u, k)) + se for k, se in zip(keys, spreads, strict=True)]
        why = exclusion(rules, family.name, u)
        error = (u["value"].get("trust") or {}).get("gradient_rel_error")
        rows.append([u["group"], u["variant"], str(u["seed"]), *cells, fmt(value_of(u, "solver_iterations"), 1),
                     "–" if error is None else percent_text(error), "**excluded**: " + why if why else "yes",
                     *provenance(u)])
    return ["<details><summary>Every run, with its provenance</summary>", "", *pipe_table(header, rows), "",
            *(["± beside a run's metric: that run's own standard error, where it records one.", ""] if errors else []),
            "</details>", ""]


def spread(unit: dict, key: str) -> str:
    """`` ± `` the unit's own standard error of ``key`` where it records one (``<key>_se``: KID's over disjoint
    sample blocks, the held-out loss's over the test images). KID's ``kid_std``, the spread of overlapping subsets,
    is no standard error and is not shown."""
    stderr = value_of(unit, f"{key}_se")
    return "" if stderr is None else f" ± {fmt(stderr)}"


def reruns_table(family: Family, judged: Metric, units: list[dict]) -> list[str]:
    """The run-to-run spread: each recorded rerun of a unit against the unit (same seed, settings and arguments),
    with both units' thread counts and commits."""
    metric = judged.key
    rows = []
    for u in units:
        path = rerun_path(Path(u["file"]))
        if not path.exists():
            continue
        again = json.loads(path.read_text())
        if (without_protocol(again["settings"]), again.get("fit")) != (without_protocol(u["settings"]), u.get("fit")):
            continue  # a rerun of another unit at this seed (e.g. another design's): not this one's spread
        a, b = value_of(u, metric), value_of(again, metric)
        same = "**yes**" if a == b else "no"
        threads = f"{u.get('threads', '–')} / {again.get('threads', '–')}"
        commits = " / ".join(provenance(x)[1] for x in (u, again))
        rows.append([u["group"], u["variant"], str(u["seed"]), repr(a), repr(b), fmt(b - a, 3), same, threads,
                     commits])
    if not rows:
        return [f"**Run-to-run spread**: no rerun recorded for these units yet (`python -m deqlab study --family "
                f"{family.name} --rerun`).", ""]
    return [f"**Run-to-run spread** (a unit run again with the same seed, settings and arguments; {metric}):", "",
            *pipe_table(["data", "variant", "seed", "unit", "rerun", "rerun - unit", "bit-identical",
                         "threads (unit / rerun)", "commit (unit / rerun)"], rows), ""]


def sampler_cost_table(units: list[dict]) -> list[str]:
    """Per DEQ arm, the sampler's cost per sample in solver iterations (network evaluations x iterations per
    evaluation, summed over the DEQ layers), each solve started cold (zero) or warm (the previous evaluation's
    fixed point), and the warm start's saving."""
    runs = [u for u in units if value_of(u, "sampling_cost")]
    if not runs:
        return []
    rows = []
    for group, name in dict.fromkeys((u["group"], u["variant"]) for u in runs):
        costs = [value_of(u, "sampling_cost") for u in runs if (u["group"], u["variant"]) == (group, name)]
        mean = {key: sum(c[key] for c in costs) / len(costs) for key in costs[0]}
        rows.append([group, name, str(len(costs)), f"{mean['evaluations_per_sample']:g}",
                     f"{mean['iterations_per_evaluation_cold']:.2f}", f"{mean['iterations_per_evaluation_warm']:.2f}",
                     f"{mean['iterations_per_sample_cold']:,.0f}", f"{mean['iterations_per_sample_warm']:,.0f}",
                     f"{mean['iterations_per_sample_cold'] / mean['iterations_per_sample_warm']:.2f}x"])
    header = ["data", "variant", "seeds", "evaluations / sample", "iterations / evaluation (cold)",
              "iterations / evaluation (warm)", "iterations / sample (cold)", "iterations / sample (warm)",
              "warm saving"]
    return ["**The sampler's cost** (the scored weights, 16 samples of seed 0 per unit, mean over seeds; iterations "
            "summed over the DEQ layers of one evaluation). A warm start saves as much as the input moves little "
            "between consecutive evaluations: a Langevin step adds noise of sqrt(2 alpha_i) = sqrt(2 step_lr) "
            "sigma_i / sigma_L per pixel (sigma_L 0.01: 0.63 sigma_i at the configs' step_lr 2e-5, 1.41 sigma_i at "
            "protocol v7's 1e-4), and a Heun step moves to the next of 18 noise levels, so the last fixed point is "
            "only a modestly better start than zero; a solve that stops at max_iter unconverged (the trust table's "
            "held-out solves say how often) costs the cap from either start. The solves also run to the training "
            "tolerance, tighter than sampling needs: `sample.py --solver-tol 1e-2` took 2.6x fewer iterations on "
            "the NCSN pilot's DEQ at an unchanged KID (benchmarks/results/ncsn_cpu_pilot/tolerance/).", "",
            *pipe_table(header, rows), ""]


def tuning_solves_table(family: Family, design: Protocol, rules: Protocol, folder: Path) -> list[str]:
    """Per DEQ arm of ``design``, its tuning runs' solves at each rate of the grid: the share of the last
    validation's forward solves that converged, their relative residual (how far from its fixed point a solve
    stopped at max_iter is left) and the share of training steps whose IFT backward missed its tolerance, beside
    the rate the validation figure chose. A rate chosen by its validation figure alone can be one at which the DEQ
    no longer reaches its fixed point (then it trains as an unrolled network of max_iter steps on an inexact
    gradient)."""
    rule = design.family(family.name).get("learning_rate")
    if rule is None:
        return []
    runs: dict[tuple[str, str], dict[float, list[dict]]] = {}
    for path in recorded_files(folder, "tuning"):  # an earlier design's kept under <group>/v<version>/tuning/
        run = json.loads(path.read_text())
        found = rules.design_of(run)
        if found is None or found.version != design.version or "val/deq/converged" not in run["value"]["validation"]:
            continue
        rate = float(next(a for a in run["value"]["arguments"] if a.startswith(f"{rule['option']}=")).split("=")[1])
        runs.setdefault((run["group"], run["variant"]), {}).setdefault(rate, []).append(run)
    rows = []
    for (group, name), by_rate in runs.items():
        chosen = rate_of_best_runs(by_rate, rule) if set(by_rate) == set(rule["grid"]) else None
        rows.append([group, name, "–" if chosen is None else f"{chosen:g}",
                     by_rate_cell(by_rate, chosen, lambda r: last_logged(r["value"]["validation"],
                                                                          "val/deq/converged")),
                     by_rate_cell(by_rate, chosen, lambda r: last_logged(r["value"]["validation"],
                                                                          "val/deq/rel_residual"),
                                  show=lambda value: f"{value:.2g}"),
                     by_rate_cell(by_rate, chosen, lambda r: r["value"].get("ift_backward_failures"))])
    if not rows:
        return []
    return ["**The DEQ arms' solves at each tuned rate** (the tuning runs, the chosen rate in bold; no chosen rate "
            "where the grid's runs are not all recorded; no misses where the backward is no IFT). A rate chosen by "
            "validation alone can be one at which the DEQ no longer reaches its fixed point: its forward solves "
            "stop at max_iter and it trains as an unrolled network on an inexact gradient; the residual says how far "
            "from its fixed point such a solve is left (against the solver's tolerance).", "",
            *pipe_table(["data", "variant", "chosen rate", "forward solves converged at the last validation",
                         "their relative residual", "IFT backward misses over training"], rows), ""]


def by_rate_cell(by_rate: dict[float, list[dict]], chosen: float | None, figure,
                 show: Callable[[float], str] = lambda value: fmt(value, 2)) -> str:
    """``rate: mean figure`` of each rate's runs (– where a run has none), the chosen rate in bold."""
    def cell(rate: float, runs: list[dict]) -> str:
        values = [figure(run) for run in runs]
        text = f"{rate:g}: " + ("–" if None in values else show(sum(values) / len(values)))
        return f"**{text}**" if rate == chosen else text
    return ", ".join(cell(rate, runs) for rate, runs in sorted(by_rate.items()))


def sample_grids(family: Family, units: list[dict], rel) -> list[str]:
    """The sample grid of every seed of every variant (beside its unit file): one row per variant, a variant with
    fewer grids than the widest padded with empty cells."""
    rows = []
    for name in family.variants:
        cells = [f"![{name} seed {u['seed']}]({rel(grid)})" for u in units if u["variant"] == name
                 and (grid := Path(u["file"]).with_suffix(".png")).exists()]
        if cells:
            rows.append([name, *cells])
    if not rows:
        return []
    width = max(map(len, rows))
    return ["Samples, every seed (columns: seeds in order):", "",
            *pipe_table(["variant", *[""] * (width - 1)], [row + [""] * (width - len(row)) for row in rows]), ""]
