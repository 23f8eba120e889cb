"""The study's page, ``docs/results.md``, written from the recorded unit files alone: per family the setting and
budget, the table (mean and standard error over seeds), the per-run facts, the figures (learning curves, test
metric against activation memory, sample grids) and the answer to the paper's question, computed by the rule the
protocol fixes. Nothing on the page is typed in by hand except the protocol's words.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

from ..units import mean_stderr
from .core import ROOT, Family, summarise, value_of

FACTS = ("parameters", "activation_memory_mb", "seconds_per_iteration", "solver_iterations", "solver_rel_residual",
         "ift_backward_failures")
ESS_RELIABLE = 100  # effective draws below which an importance-sampling estimate is marked unreliable

PROTOCOL = """\
The comparisons were fixed before any test metric was seen, and no variant was tuned after one was. Every family:
seeds 0, 1, 2; one budget for all variants of a family (iterations, batch, learning rate, data as in the family's
configs); the final weights scored on the test split (DKEF: the model of its closing stage, from the best
validation weights; NCSN: the trained weights, not their EMA average, a change made for every NCSN variant after
the first NCSN samples had been seen, because the average spans more steps than the runs train);
mean and standard error over seeds in every table; parameters, activation memory of one step, seconds per
training iteration, the device, the solver's mean iterations and final residual, and the fraction of backward
solves that missed their tolerance beside every run.

**The claim holds** for a data set when the DEQ's test metric is better than the shallow explicit network's, or
worse by less than one standard error of the difference of the two means (over seeds). The distance to the deep
explicit network is stated the same way, and the memory beside it. NCSN's metric is KID; DKEF's is the test
log-likelihood, and a DKEF run whose log Z rests on fewer than 100 effective draws is marked unreliable.
"""


def load_units(out: Path, family: Family) -> tuple[list[dict], int]:
    """The family's recorded units, in the family's group and variant order, then by seed, and how many were left
    out: of several settings (budgets), only the units of the most common are kept (a table never mixes them)."""
    units = [json.loads(p.read_text()) for p in sorted((out / family.name).glob("*/*.json"))]
    units = [u for u in units if u["group"] in family.groups and u["variant"] in family.variants]
    if not units:
        return [], 0
    common, _ = Counter(json.dumps(u["settings"], sort_keys=True) for u in units).most_common(1)[0]
    kept = [u for u in units if json.dumps(u["settings"], sort_keys=True) == common]
    groups, variants = list(family.groups), list(family.variants)
    kept.sort(key=lambda u: (groups.index(u["group"]), variants.index(u["variant"]), u["seed"]))
    return kept, len(units) - len(kept)


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


def compare(family: Family, summaries: dict[str, dict], a: str, b: str) -> dict | None:
    """``a`` against ``b`` on the family's first metric: the difference of means oriented so that positive is
    better for ``a``, its standard error, and whether ``a`` is better or within one standard error."""
    key = family.metrics[0].key
    if key not in summaries.get(a, {}) or key not in summaries.get(b, {}):
        return None
    sa, sb = summaries[a][key], summaries[b][key]
    sign = 1.0 if family.metrics[0].higher_is_better else -1.0
    diff = sign * (sa["mean"] - sb["mean"])
    se = None if sa["stderr"] is None or sb["stderr"] is None else math.hypot(sa["stderr"], sb["stderr"])
    return {"diff": diff, "stderr": se, "holds": diff >= 0 or (se is not None and diff >= -se)}


def better_or_worse(comparison: dict) -> str:
    return "better" if comparison["diff"] >= 0 else "worse"


def variant_of_role(family: Family, role: str) -> str | None:
    return next((name for name, v in family.variants.items() if v.role == role), None)


def claim(family: Family, summaries: dict[str, dict]) -> dict | None:
    """The protocol's comparisons on one data set: the DEQ against the shallow and the deep explicit networks on
    the family's first metric, whether the claim holds (None: not judged, a single seed on a side or networks
    still no better than the untrained one: ``still_noise``), and the DEQ's activation memory as a fraction of
    theirs; None when the DEQ or the shallow network has no run."""
    deq, shallow, deep = (variant_of_role(family, r) for r in ("deq", "shallow", "deep"))
    vs_shallow = compare(family, summaries, deq, shallow)
    if vs_shallow is None:
        return None
    memory = {name: summaries.get(name, {}).get("activation_memory_mb", {}).get("mean")
              for name in (deq, shallow, deep)}
    ratio = {name: memory[deq] / memory[name] if memory[deq] and memory[name] else None for name in (shallow, deep)}
    judged = None if vs_shallow["stderr"] is None else vs_shallow["holds"]  # one seed: better or not, noise unknown
    still_noise = learnt(family, summaries)[0] is False  # then the comparison says nothing about the claim
    if still_noise:
        judged = None
    return {"vs_shallow": vs_shallow, "vs_deep": compare(family, summaries, deq, deep), "holds": judged,
            "still_noise": still_noise,
            "memory_vs_shallow": ratio[shallow], "memory_vs_deep": ratio[deep],
            "seeds": (len(summaries[deq]["seeds"]), len(summaries[shallow]["seeds"]))}


def judged_word(result: dict) -> str:
    return {True: "holds", False: "does not hold", None: "cannot be judged"}[result["holds"]]


def verdict(family: Family, group: str, summaries: dict[str, dict]) -> str:
    """The paragraph answering the paper's question for one data set, from the numbers alone."""
    metric = family.metrics[0]
    result = claim(family, summaries)
    if result is None:
        return " ".join([f"{group}: not enough runs recorded to compare the DEQ with the shallow network.",
                         *untrained_check(family, summaries)])
    vs_shallow, vs_deep = result["vs_shallow"], result["vs_deep"]
    if vs_shallow["stderr"] is None:
        se = " (a single seed on one side: no standard error)"
    else:
        se = f" ± {fmt(vs_shallow['stderr'])} (difference of means ± its standard error)"
    parts = [f"On {group}, the DEQ's {metric.label} is {better_or_worse(vs_shallow)} than the shallow explicit "
             f"network's by {fmt(abs(vs_shallow['diff']))}{se}: the claim {judged_word(result)} here."]
    if vs_deep is not None:
        se = "" if vs_deep["stderr"] is None else f" ± {fmt(vs_deep['stderr'])}"
        parts.append(f"Against the deep explicit network it is {better_or_worse(vs_deep)} by "
                     f"{fmt(abs(vs_deep['diff']))}{se}.")
    if result["memory_vs_shallow"] is not None:
        deep_ratio = "" if result["memory_vs_deep"] is None else f" and {result['memory_vs_deep']:.2f} x the deep one's"
        parts.append(f"Its activation memory per step is {result['memory_vs_shallow']:.2f} x the shallow "
                     f"network's{deep_ratio}.")
    return " ".join([*parts, *untrained_check(family, summaries)])


def learnt(family: Family, summaries: dict[str, dict]) -> tuple[bool | None, dict | None]:
    """Whether the best trained variant is clearly (three standard errors) better than the untrained network, and
    that variant's summary; (None, None) where the family has no untrained run, (None, best) with a single seed."""
    metric = family.metrics[0]
    untrained = variant_of_role(family, "untrained")
    trained = [s for name, s in summaries.items() if name != untrained and metric.key in s]
    if untrained not in summaries or metric.key not in summaries[untrained] or not trained:
        return None, None
    best = (max if metric.higher_is_better else min)(trained, key=lambda s: s[metric.key]["mean"])
    gap = compare(family, summaries, best["variant"], untrained)
    return (None if gap["stderr"] is None else gap["diff"] > 3 * gap["stderr"]), best


def untrained_check(family: Family, summaries: dict[str, dict]) -> list[str]:
    """The sentence on :func:`learnt`: without it, a comparison of the variants may be one between networks that
    are still noise."""
    clearly, best = learnt(family, summaries)
    if best is None:
        return []
    metric, untrained = family.metrics[0], variant_of_role(family, "untrained")
    if clearly is None:
        judged = "a single seed on one side, so whether the variants learnt something cannot be judged."
    elif clearly:
        judged = "better by more than three standard errors: the variants learnt something measurable, which is " \
                 "not to say their samples look like the data (see the grids)."
    else:
        judged = "not clearly better, so this comparison is between networks that are still noise and says " \
                 "nothing about the claim."
    return [f"The best trained variant ({best['variant']}, {mean_cell(best, metric.key)}) against the "
            f"untrained network ({mean_cell(summaries[untrained], metric.key)}): {judged}"]


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(family: Family, units: list[dict], group: str, path: Path) -> None:
    """Training and validation loss against the training iteration, mean over seeds with a standard-error band."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key in zip(axes, ("train/loss", "val/loss"), strict=True):
        for name, variant in family.variants.items():
            runs = [u["value"] for u in units if u["group"] == group and u["variant"] == name]
            series = [dict(r["curves"].get(key, [])) for r in runs if r["iterations"]]
            steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
            if not steps:
                continue
            per_iteration = runs[0]["optimiser_steps"] / runs[0]["iterations"]
            stats = [mean_stderr([s[t] for s in series]) for t in steps]
            xs = [t / per_iteration for t in steps]
            mean = [m for m, _ in stats]
            err = [e or 0.0 for _, e in stats]
            ax.plot(xs, mean, label=f"{name} ({variant.role})")
            ax.fill_between(xs, [m - e for m, e in zip(mean, err, strict=True)],
                            [m + e for m, e in zip(mean, err, strict=True)], alpha=0.25)
        ax.set_title(f"{family.title}, {group}: {key}")
        ax.set_xlabel("training iteration")
        ax.set_yscale("symlog")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_quality_memory(family: Family, summaries: list[dict], path: Path) -> None:
    """The family's first metric against activation memory per step: one point per variant with its standard
    error, one panel per data set."""
    plt = pyplot()
    metric = family.metrics[0]
    groups = list(dict.fromkeys(s["group"] for s in summaries))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, group in zip(axes[0], groups, strict=True):
        for s in (s for s in summaries if s["group"] == group):
            if metric.key not in s or "activation_memory_mb" not in s:
                continue
            y = s[metric.key]
            ax.errorbar(s["activation_memory_mb"]["mean"], y["mean"], yerr=y["stderr"] or 0.0, fmt="o", capsize=3,
                        label=f"{s['variant']} ({family.variants[s['variant']].role})")
        ax.set_xscale("log")
        ax.set_xlabel("activation memory per step (MiB)")
        ax.set_ylabel(f"{metric.label} ({'higher' if metric.higher_is_better else 'lower'} is better)")
        ax.set_title(f"{family.title}: {group}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def family_section(family: Family, units: list[dict], out: Path, page: Path,
                   left_out: int = 0) -> tuple[list[str], list[str]]:
    """The page's section of one family (figures written under ``out/<family>/``) and its rows of the summary."""
    if not units:
        return [f"## {family.title}", "", f"No runs recorded yet: `python -m deqscore.bench.study --family "
                f"{family.name} --seeds 0,1,2`.", ""], [f"| {family.title} | – | no runs yet | | | | |"]
    rel = lambda p: relative(p, page)  # noqa: E731
    settings = units[0]["settings"]
    keys = [m.key for m in family.metrics] + list(FACTS)
    summaries = summarise(units, keys)
    devices = sorted({u["device"] for u in units})
    lines = [f"## {family.title}", "", family.setting, "",
             f"* **budget**: {settings['budget']} x the default, {settings['iterations']:,} training iterations "
             f"per run; evaluation {settings['evaluation'] or 'as configured'}"
             + (f"; extra arguments `{' '.join(settings['extra'])}`" if settings["extra"] else ""),
             f"* **device**: {', '.join(devices)}",
             f"* **command**: `python -m deqscore.bench.study --family {family.name} --seeds "
             f"{','.join(map(str, sorted({u['seed'] for u in units})))} --budget {settings['budget']}`",
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
    lines += per_run_table(family, units)
    figures = out / family.name
    for group in family.groups:
        if any(u["group"] == group for u in units):
            plot_curves(family, units, group, figures / f"curves_{group}.png")
            lines += [f"![{family.title}, {group}: learning curves]({rel(figures / f'curves_{group}.png')})", ""]
    plot_quality_memory(family, summaries, figures / "quality_vs_memory.png")
    lines += [f"![{family.title}: test metric against memory]({rel(figures / 'quality_vs_memory.png')})", ""]
    lines += sample_grids(family, units, out, rel)
    by_group: dict[str, dict[str, dict]] = {}
    for s in summaries:
        by_group.setdefault(s["group"], {})[s["variant"]] = s
    lines += ["**What the measurements say.** " + " ".join(verdict(family, g, v) for g, v in by_group.items()), ""]
    return lines, [summary_row(family, group, summaries) for group, summaries in by_group.items()]


def summary_row(family: Family, group: str, summaries: dict[str, dict]) -> str:
    result = claim(family, summaries)
    if result is None:
        return f"| {family.title} | {group} | not enough runs | | | | |"
    word = "cannot be judged: still noise" if result["still_noise"] else judged_word(result)
    diff = result["vs_shallow"]
    cell = f"{diff['diff']:+.3g}" + ("" if diff["stderr"] is None else f" ± {diff['stderr']:.2g}")
    ratio = lambda r: "–" if r is None else f"{r:.2f}"  # noqa: E731
    return (f"| {family.title} | {group} | {family.metrics[0].label} | {result['seeds'][0]} / {result['seeds'][1]} | "
            f"{cell} | **{word}** | {ratio(result['memory_vs_shallow'])} / "
            f"{ratio(result['memory_vs_deep'])} |")


def per_run_table(family: Family, units: list[dict]) -> list[str]:
    """Every run: its metrics (with their own spread where the metric has one, e.g. KID's standard deviation over
    subsets) and solver facts; a log Z resting on fewer than :data:`ESS_RELIABLE` effective draws is flagged."""
    keys = [m.key for m in family.metrics]
    lines = ["<details><summary>Every run</summary>", "",
             "| data | variant | seed | " + " | ".join(keys + ["solver iterations", "final rel. residual"]) + " |",
             "|" + "---|" * (5 + len(keys))]
    for u in units:
        cells = [fmt(value_of(u, k)) + spread(u, k) for k in keys]
        ess = value_of(u, "log_z_ess")
        if ess is not None and ess < ESS_RELIABLE:
            cells[0] += " (unreliable: ESS < 100)"
        lines.append(f"| {u['group']} | {u['variant']} | {u['seed']} | {' | '.join(cells)} | "
                     f"{fmt(value_of(u, 'solver_iterations'), 1)} | {fmt(value_of(u, 'solver_rel_residual'))} |")
    return lines + ["", "</details>", ""]


def spread(unit: dict, key: str) -> str:
    std = value_of(unit, f"{key}_std")
    return "" if std is None else f" ± {fmt(std)}"


def sample_grids(family: Family, units: list[dict], out: Path, rel) -> list[str]:
    """The first seed's sample grid of each variant, side by side."""
    cells = []
    for name in family.variants:
        runs = [u for u in units if u["variant"] == name]
        if runs:
            grid = out / family.name / runs[0]["group"] / f"{name}_s{runs[0]['seed']}.png"
            if grid.exists():
                cells.append((f"{name} (seed {runs[0]['seed']})", f"![{name}]({rel(grid)})"))
    if not cells:
        return []
    return ["| " + " | ".join(c[0] for c in cells) + " |", "|" + "---|" * len(cells),
            "| " + " | ".join(c[1] for c in cells) + " |", ""]


def write_page(out: Path, page: Path, families: list[Family]) -> str:
    """``page`` from the unit files under ``out``; the markdown."""
    lines = ["# Results: the reproduction study", "",
             "Written by `python -m deqscore.bench.study --report` from the unit files under "
             f"`{rel_to_root(out)}/` (one per family, data set, variant and seed); do not edit by hand. Benchmarks of "
             "speed and memory: [benchmarks.md](benchmarks.md). The question, from the paper: at the same budget, "
             "does a DEQ score network reach the quality of an explicit one, and how close does it come to a "
             "deeper explicit one, at what memory?", "", "## Protocol", "", PROTOCOL]
    sections, rows = [], []
    for family in families:
        units, left_out = load_units(out, family)
        section, family_rows = family_section(family, units, out, page, left_out)
        sections += section
        rows += family_rows
    lines += ["## Summary", "",
              "| family | data | metric | seeds (DEQ / shallow) | DEQ - shallow (positive: DEQ better) | the claim | "
              "DEQ memory / shallow, / deep |", "|---|---|---|---|---|---|---|", *rows, "", *sections]
    lines += ["## Memory against depth", "",
              "Explicit stacks of each family's own DEQ block against the DEQ (`python -m deqscore.bench --sections "
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
