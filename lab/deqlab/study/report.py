"""The study's page, ``docs/results.md``, written from the recorded unit files and the protocol alone: the
protocol and its deviations, then per family the setting and budget, the table (mean and standard error over
seeds), the non-inferiority verdict of every comparison (:mod:`.verdict`) with its converged / early-training
mark, the DEQs' trust figures (:mod:`.trust`), the per-run facts and the figures (:mod:`.figures`: learning
curves, test metric against activation memory; every seed's sample grid). Nothing on the page is typed in by hand.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import Counter
from pathlib import Path

from .core import ROOT, Family, seed_curve, summarise, value_of, without_protocol
from .figures import plot_curves, plot_quality_memory
from .protocol import Protocol, check_units
from .verdict import MAX_SEEDS, non_inferiority

FACTS = ("parameters", "activation_memory_mb", "seconds_per_iteration", "solver_iterations", "solver_rel_residual",
         "ift_backward_failures")
ESS_RELIABLE = 100  # effective draws below which an importance-sampling estimate is marked unreliable

DEQ_ROLES = ("deq", "deq_faithful")  # the networks the claim is about, each judged against the explicit ones

def load_units(out: Path, family: Family, protocol: Protocol) -> tuple[list[dict], int]:
    """The family's recorded units, in the family's group and variant order, then by seed, and how many were left
    out: of several settings (budgets), only the units of the most common are kept (a table never mixes them).
    A unit the protocol does not govern (another version that governs it differently, or an edited file) is refused
    (:class:`ProtocolError`)."""
    units = [json.loads(p.read_text()) for p in sorted((out / family.name).glob("*/*.json"))]
    units = [u for u in units if u["group"] in family.groups and u["variant"] in family.variants]
    check_units(protocol, units)
    if not units:
        return [], 0
    shared = lambda u: json.dumps(without_protocol(u["settings"]), sort_keys=True)  # noqa: E731
    common, _ = Counter(shared(u) for u in units).most_common(1)[0]
    kept = [u for u in units if shared(u) == common]
    groups, variants = list(family.groups), list(family.variants)
    kept.sort(key=lambda u: (groups.index(u["group"]), variants.index(u["variant"]), u["seed"]))
    return kept, len(units) - len(kept)


def on_protocol(family: Family, protocol: Protocol, settings: dict) -> bool:
    """Whether units of ``settings`` ran as the protocol says (budget, evaluation, fit options, no extras)."""
    entry = protocol.family(family.name)
    return (settings["budget"] == entry["budget"] and settings["evaluation"] == entry["evaluation"]
            and settings["fit"] == entry["fit"] and not settings["extra"])


def recorded_under(units: list[dict], protocol: Protocol) -> str:
    """Which earlier versions the units ran under, where some did (they count: the protocol governs them alike)."""
    earlier = Counter(u["settings"]["protocol"]["version"] for u in units
                      if u["settings"]["protocol"]["version"] != protocol.version)
    if not earlier:
        return ""
    return " (" + ", ".join(f"{n} unit{'s' if n > 1 else ''} recorded under v{v}, which governs them alike"
                            for v, n in sorted(earlier.items())) + ")"


def code_of(units: list[dict]) -> str:
    """The commits the units' code came from (``not recorded`` for units that predate the record)."""
    def one(code: dict | None) -> str:
        if code is None:
            return "not recorded"
        return f"`{code['commit'][:10]}`" + (" with uncommitted changes" if code["uncommitted_changes"] else "")
    counts = Counter(one(u.get("code")) for u in units)
    return ", ".join(f"{what} ({n} unit{'s' if n > 1 else ''})" for what, n in sorted(counts.items()))


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1e4 or (value != 0 and abs(value) < 10 ** -digits):
        return f"{value:.{digits}g}"
    return f"{value:,.{digits}f}"


def mean_cell(summary: dict, key: str, digits: int = 3) -> str:
    if key not in summary:
        return "–"
    cell = summary[key]
    stderr = "" if cell["stderr"] is None else f" ± {fmt(cell['stderr'], digits)}"
    return f"{fmt(cell['mean'], digits)}{stderr}"


def variant_of_role(family: Family, role: str) -> str | None:
    return next((name for name, v in family.variants.items() if v.role == role), None)


def per_seed(units: list[dict], group: str, variant: str | None, key: str) -> list[float]:
    return [v for u in units if (u["group"], u["variant"]) == (group, variant) and (v := value_of(u, key)) is not None]


def comparisons(family: Family, protocol: Protocol, units: list[dict], group: str,
                summaries: dict[str, dict]) -> list[dict]:
    """Every DEQ variant against the shallow and the deep explicit networks on one data set: the non-inferiority
    test at the protocol's margin (None with fewer than two seeds a side) and the DEQ's activation memory as a
    fraction of the other's."""
    metric = family.metrics[0]
    shallow, deep = variant_of_role(family, "shallow"), variant_of_role(family, "deep")
    shallow_mean = summaries.get(shallow, {}).get(metric.key, {}).get("mean")
    margin = protocol.margin(family.name, shallow_mean)
    memory = {name: s.get("activation_memory_mb", {}).get("mean") for name, s in summaries.items()}
    out = []
    for deq in (n for n, v in family.variants.items() if v.role in DEQ_ROLES and n in summaries):
        for other in (n for n in (shallow, deep) if n in summaries):
            deq_values, other_values = (per_seed(units, group, n, metric.key) for n in (deq, other))
            if not deq_values or not other_values:
                continue
            test = None if margin is None else non_inferiority(deq_values, other_values, margin,
                                                               metric.higher_is_better)
            ratio = memory[deq] / memory[other] if memory.get(deq) and memory.get(other) else None
            out.append({"deq": deq, "other": other, "role": family.variants[other].role, "test": test,
                        "margin": margin, "memory_ratio": ratio, "seeds": (len(deq_values), len(other_values))})
    return out


def flattened(protocol: Protocol, units: list[dict], group: str, variant: str | None) -> tuple[bool | None, float]:
    """Whether ``variant``'s validation curve (mean over seeds) has flattened by the protocol's definition, and its
    relative improvement over the last window of training; (None, nan) without two common validation points."""
    rule = protocol.text["flattened"]
    curve = seed_curve([u["value"] for u in units if (u["group"], u["variant"]) == (group, variant)], "val/loss")
    if len(curve) < 2:
        return None, math.nan
    mean = {t: m for t, (m, _) in curve.items()}
    steps = list(curve)
    last = steps[-1]
    earlier = min(steps[:-1], key=lambda t: abs(t - (1 - rule["window"]) * last))
    improvement = (mean[earlier] - mean[last]) / max(abs(mean[last]), 1e-30)
    return improvement < rule["below"], improvement


def comparison_row(family: Family, group: str, c: dict, training: str) -> str:
    """One row of a comparison table (also the summary's, with the family in front)."""
    test = c["test"]
    ratio = "–" if c["memory_ratio"] is None else f"{c['memory_ratio']:.2f}"
    if test is None:
        why = "margin unknown" if c["margin"] is None else "fewer than two seeds a side"
        return (f"| {group} | {c['deq']} vs {c['other']} ({c['role']}) | {c['seeds'][0]} / {c['seeds'][1]} | – | – "
                f"| – | – | {fmt(c['margin'])} | **not judged** ({why}) | {training} | {ratio} |")
    needed = "" if test.verdict != "inconclusive" else (
        f"; {test.seeds_needed} seeds per arm would decide" if test.seeds_needed else
        f"; more than {MAX_SEEDS:,} seeds per arm would be needed")
    return (f"| {group} | {c['deq']} vs {c['other']} ({c['role']}) | {c['seeds'][0]} / {c['seeds'][1]} | "
            f"{test.d:+.3g} ± {test.se:.2g} | {test.df:.1f} | {test.lower:+.3g} | {test.supported_margin:.3g} | "
            f"{fmt(c['margin'])} | **{test.verdict}**{needed} | {training} | {ratio} |")


COMPARISON_HEADER = ["| data | comparison | seeds (DEQ / other) | d ± se (positive: DEQ better) | Welch df | L (95 %) "
                     "| supported margin (-L) | margin | verdict | training | DEQ memory / other |",
                     "|---|---|---|---|---|---|---|---|---|---|---|"]


def training_mark(converged: bool | None, improvement: float) -> str:
    if converged is None:
        return "no curve"
    if improvement < 0:  # past its best: the val loss rose over the last fifth
        return "converged (val loss rose over the last fifth)"
    return f"{'converged' if converged else 'early-training'} ({improvement:+.1%} over the last fifth)"


def control_sentence(family: Family, protocol: Protocol, summaries: dict[str, dict]) -> list[str]:
    """The untrained network as a control (never an override of the verdict): each trained variant's metric as a
    fraction of the untrained network's, against the protocol's criterion."""
    untrained, metric = variant_of_role(family, "untrained"), family.metrics[0]
    base = summaries.get(untrained, {}).get(metric.key, {}).get("mean")
    if not base:
        return []
    ratios = [f"{name} {s[metric.key]['mean'] / base:.2f}" for name, s in summaries.items()
              if name != untrained and metric.key in s]
    criterion = protocol.family(family.name).get("control", "")
    return [f"Control: each trained variant's {metric.label} as a fraction of the untrained network's "
            f"({fmt(base)}): {', '.join(ratios) or 'no trained run yet'}. {criterion}"]


def family_section(family: Family, units: list[dict], out: Path, page: Path, protocol: Protocol,
                   left_out: int = 0) -> tuple[list[str], list[str]]:
    """The page's section of one family (figures written under ``out/<family>/``) and its rows of the summary."""
    if not units:
        return [f"## {family.title}", "", f"No runs recorded under protocol v{protocol.version} yet: `python -m "
                f"deqlab study --family {family.name}`.", ""], [f"| {family.title} | – | no runs yet |" +
                                                                        " |" * 9]
    rel = lambda p: relative(p, page)  # noqa: E731
    settings = units[0]["settings"]
    keys = [m.key for m in family.metrics] + list(FACTS)
    summaries = summarise(units, keys)
    devices = sorted({u["device"] for u in units})
    lines = [f"## {family.title}", "", family.setting, "",
             f"* **budget**: {settings['budget']} x the default, {settings['iterations']:,} training iterations "
             f"per run; evaluation {settings['evaluation'] or 'as configured'}"
             + (f"; extra arguments `{' '.join(settings['extra'])}`" if settings["extra"] else ""),
             f"* **protocol**: v{protocol.version}" + recorded_under(units, protocol)
             + ("" if on_protocol(family, protocol, settings) else
                ", **off-protocol settings** (a trial: not evidence)"),
             f"* **device**: {', '.join(devices)}" + (" (time figures from different CPU models are not "
                                                     "comparable)" if len(devices) > 1 else ""),
             f"* **code**: {code_of(units)}",
             f"* **command**: `python -m deqlab study --family {family.name}`",
             *([f"* **context (not comparable)**: {family.context}"] if family.context else []),
             *([f"* **left out**: {left_out} unit files recorded with other settings"] if left_out else []), ""]
    header = [m.label for m in family.metrics]
    lines += ["| data | variant | role | seeds | " + " | ".join(header) + " | parameters | activation memory (MiB) "
              "| s / iteration | solver iterations | IFT misses |",
              "|" + "---|" * (9 + len(header))]
    for s in summaries:
        variant = family.variants[s["variant"]]
        cells = [mean_cell(s, m.key) for m in family.metrics]
        unreliable = sum(1 for u in units if (u["group"], u["variant"]) == (s["group"], s["variant"])
                         and (value_of(u, "log_z_ess") or math.inf) < ESS_RELIABLE)
        if unreliable:
            cells[0] += f" ({unreliable} of {len(s['seeds'])} with ESS < {ESS_RELIABLE}: unreliable)"
        params = s.get("parameters", {}).get("mean")
        lines.append(f"| {s['group']} | {s['variant']} | {variant.role} | {len(s['seeds'])} | {' | '.join(cells)} | "
                     f"{'–' if params is None else f'{params:,.0f}'} | {mean_cell(s, 'activation_memory_mb', 2)} | "
                     f"{mean_cell(s, 'seconds_per_iteration', 3)} | {mean_cell(s, 'solver_iterations', 1)} | "
                     f"{mean_cell(s, 'ift_backward_failures', 2)} |")
    lines += ["", "Mean ± standard error over the seeds; – where a variant has no such figure (an explicit network "
              "has no solver; the IFT column only where the backward is the IFT). Activation memory: the tensors "
              "one training step saves for backward. s / iteration: wall clock of `train.py fit` over its "
              "iterations, validation and checkpointing included (DKEF: also its closing stage), on a machine "
              "shared with other jobs: a rough figure; the benchmarks measure speed.", ""]
    by_group: dict[str, dict[str, dict]] = {}
    for s in summaries:
        by_group.setdefault(s["group"], {})[s["variant"]] = s
    rows, table = [], []
    for group, group_summaries in by_group.items():
        mark = training_mark(*flattened(protocol, units, group, variant_of_role(family, "shallow")))
        for c in comparisons(family, protocol, units, group, group_summaries):
            table.append(comparison_row(family, group, c, mark))
            rows.append(f"| {family.title} | " + table[-1][2:])
    lines += [f"**The verdicts** ({family.metrics[0].label}, margin {margin_text(family, protocol)}):", "",
              *COMPARISON_HEADER, *(table or ["| – | no comparison recorded yet |" + " |" * 9]), ""]
    for group_summaries in by_group.values():
        lines += control_sentence(family, protocol, group_summaries)
    lines += ["", *trust_table(family, units, protocol), *per_run_table(family, units)]
    figures = out / family.name
    for group in family.groups:
        if any(u["group"] == group for u in units):
            plot_curves(family, units, group, figures / f"curves_{group}.png")
            lines += [f"![{family.title}, {group}: learning curves]({rel(figures / f'curves_{group}.png')})", ""]
    plot_quality_memory(family, summaries, figures / "quality_vs_memory.png")
    lines += [f"![{family.title}: test metric against memory]({rel(figures / 'quality_vs_memory.png')})", ""]
    lines += sample_grids(family, units, out, rel)
    return lines, rows


def margin_text(family: Family, protocol: Protocol) -> str:
    entry = protocol.family(family.name)
    if "margin" in entry:
        return f"{entry['margin']} {entry['margin_unit']}"
    return f"{entry['margin_relative_to_shallow']:.0%} of the shallow network's mean"


def trust_table(family: Family, units: list[dict], protocol: Protocol) -> list[str]:
    """Mean over seeds of each DEQ variant's trust figures; a variant whose training gradient is further from the
    exact one than the protocol allows is marked."""
    threshold = protocol.text["trust"]["faithful_below"]
    runs = [u for u in units if u["value"].get("trust")]
    if not runs:
        return []
    lines = ["**Trust figures** (final weights, first test batch; mean over seeds, max over seeds in brackets):", "",
             "| data | variant | seeds | contraction | K | contraction^K | derivative error | objective error | "
             "gradient error | capped solves (test / training) | unrolled solve converged | faithful |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for group, name in dict.fromkeys((u["group"], u["variant"]) for u in runs):
        figures = [u["value"]["trust"] for u in runs if (u["group"], u["variant"]) == (group, name)]
        cell = functools.partial(trust_cell, figures)

        worst = max(f["gradient_rel_error"] for f in figures)
        faithful = "yes" if worst < threshold else f"**no** (> {threshold:.0%})"
        lines.append(f"| {group} | {name} | {len(figures)} | {cell('contraction')} | {figures[0]['phantom_steps']} | "
                     f"{cell('neumann_remainder')} | {cell('derivative_rel_error', True)} | "
                     f"{cell('objective_rel_error', True)} | {cell('gradient_rel_error', True)} | "
                     f"{cell('capped_solves', True)} / {cell('capped_solves_training', True)} | "
                     f"{sum(f['exact_converged'] for f in figures)} of {len(figures)} | {faithful} |")
    return [*lines, ""]


def trust_cell(figures: list[dict], key: str, percent: bool = False) -> str:
    """Mean over runs of one trust figure, the largest in brackets."""
    values = [f[key] for f in figures if f.get(key) is not None]
    if not values:
        return "–"
    show = (lambda v: f"{v:.1%}") if percent else fmt  # noqa: E731
    return f"{show(sum(values) / len(values))} ({show(max(values))})"


def per_run_table(family: Family, units: list[dict]) -> list[str]:
    """Every run: its metrics (with their own spread where the metric has one, e.g. KID's standard deviation over
    subsets) and solver facts; a log Z resting on fewer than :data:`ESS_RELIABLE` effective draws is flagged."""
    keys = [m.key for m in family.metrics]
    lines = ["<details><summary>Every run</summary>", "",
             "| data | variant | seed | device | " + " | ".join(keys + ["solver iterations", "final rel. residual",
                                                                   "gradient error"]) + " |",
             "|" + "---|" * (7 + len(keys))]
    for u in units:
        cells = [fmt(value_of(u, k)) + spread(u, k) for k in keys]
        ess = value_of(u, "log_z_ess")
        if ess is not None and ess < ESS_RELIABLE:
            cells[0] += " (unreliable: ESS < 100)"
        trust = u["value"].get("trust") or {}
        error = trust.get("gradient_rel_error")
        lines.append(f"| {u['group']} | {u['variant']} | {u['seed']} | {u['device']} | {' | '.join(cells)} | "
                     f"{fmt(value_of(u, 'solver_iterations'), 1)} | {fmt(value_of(u, 'solver_rel_residual'))} | "
                     f"{'–' if error is None else f'{error:.1%}'} |")
    return lines + ["", "</details>", ""]


def spread(unit: dict, key: str) -> str:
    std = value_of(unit, f"{key}_std")
    return "" if std is None else f" ± {fmt(std)}"


def sample_grids(family: Family, units: list[dict], out: Path, rel) -> list[str]:
    """The sample grid of every seed of every variant: one row per variant."""
    rows = []
    for name in family.variants:
        cells = [f"![{name} seed {u['seed']}]({rel(grid)})" for u in units if u["variant"] == name
                 and (grid := out / family.name / u["group"] / f"{name}_s{u['seed']}.png").exists()]
        if cells:
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    width = max(row.count(" | ") for row in rows)
    return ["Samples, every seed (columns: seeds in order):", "", "| variant |" + " |" * width,
            "|" + "---|" * (width + 1), *rows, ""]


def protocol_section(protocol: Protocol) -> list[str]:
    """The protocol as the file states it: rule, definitions and each family's fixed settings."""
    text, rule = protocol.text, protocol.text["rule"]
    lines = ["## Protocol", "",
             f"Version {protocol.version}: `{rel_to_root(protocol.path)}` (SHA-256 `{protocol.sha256}`), fixed "
             f"{text['fixed']}. Every unit on this page records the version and hash it ran under: this one, or an "
             "earlier version whose file is unedited and governs it alike (the rule, the definitions, the trust "
             "threshold, its family's entry and its variant's seeds read the same). The report refuses any other "
             "unit, and a change to the file is a new version with its deviations listed below.", "",
             f"**The question.** {text['question']}", "",
             f"**The rule.** {rule['test']}. At the family's margin: **holds** when {rule['holds']}; **fails** "
             f"when {rule['fails']}; **inconclusive** {rule['inconclusive']}. alpha = {rule['alpha']} one-sided; "
             f"at least {rule['minimum_seeds']} seeds a side. The same test against the deep explicit network. "
             "The supported margin (-L) is the smallest margin at which the comparison would hold.", "",
             f"**Converged or early-training.** {text['flattened']['definition']}.", "",
             f"**Trust figures.** {text['trust']['what']}.", "",
             "| family | metric | better | margin | budget | seeds | evaluation | fit options | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, entry in text["families"].items():
        notes = "; ".join(entry[k] for k in ("faithful", "sampler", "control") if k in entry)
        seeds = ", ".join(f"{v} {n}" for v, n in entry["seeds"].items())
        margin = (f"{entry['margin']} {entry['margin_unit']}" if "margin" in entry else
                  f"{entry['margin_relative_to_shallow']:.0%} of the shallow {entry['margin_unit']}")
        lines.append(f"| {name} | {entry['metric']} | {'higher' if entry['higher_is_better'] else 'lower'} | "
                     f"{margin} | {entry['budget']} x | {seeds} | {entry['evaluation']} | "
                     f"`{' '.join(entry['fit'])}` | {notes} |")
    return [*lines, ""]


def deviations_section(protocol: Protocol) -> list[str]:
    lines = ["## Deviations", "", "Every change to how the study is run or judged, with the version it belongs "
             "to and whether it was made before or after results were seen.", "",
             "| version | decided | change |", "|---|---|---|"]
    lines += [f"| {d['version']} | {d['seen']} | {d['change']} |" for d in protocol.text["deviations"]]
    return [*lines, ""]


def write_page(out: Path, page: Path, families: list[Family], protocol: Protocol) -> str:
    """``page`` from the unit files under ``out``, judged by ``protocol``; the markdown."""
    sections, rows = [], []
    for family in families:
        units, left_out = load_units(out, family, protocol)
        section, family_rows = family_section(family, units, out, page, protocol, left_out)
        sections += section
        rows += family_rows
    lines = ["# Results: the reproduction study", "",
             "Written by `python -m deqlab study --report` from the unit files under "
             f"`{rel_to_root(out)}/` (one per family, data set, variant and seed); do not edit by hand. Benchmarks of "
             "speed and memory: [benchmarks.md](benchmarks.md).", "",
             "## Summary", "", "Every comparison's non-inferiority verdict at the protocol's margin, the smallest "
             "margin the data support, and whether the shallow network's curve had flattened.", "",
             "| family " + COMPARISON_HEADER[0], "|---" + COMPARISON_HEADER[1], *rows, "",
             *protocol_section(protocol), *deviations_section(protocol), *sections]
    lines += ["## Memory against depth", "",
              "Explicit stacks of each family's own DEQ block against the DEQ (`python -m deqlab --sections "
              "depth`); see [benchmarks.md](benchmarks.md#memory-against-depth-per-family).", ""]
    depth = out.parent / "depth"
    lines += [f"![depth: {p.stem}]({relative(p, page)})"
              for p in sorted(depth.glob("depth_*.png"))]
    text = "\n".join(lines).rstrip() + "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    return text


def relative(path: Path, page: Path) -> str:
    """``path`` as a link from ``page``."""
    return Path(os.path.relpath(path, page.parent)).as_posix()


def rel_to_root(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)
