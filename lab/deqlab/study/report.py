"""The study's page, ``docs/results.md``, written from the recorded unit files and the protocol alone: the
protocol and its deviations, then per family and per design (the protocol version whose training settings the
units ran under: the newest first, earlier designs after it, never pooled) the setting and budget, each arm's
table (its protocol seeds, missing and excluded ones named; mean and standard error; its validation curve's
label), the comparisons judged by the newest protocol's rules (:mod:`.judging`: exact seeds, interim marks, log Z,
Holm), the run-to-run spread, the DEQs' trust figures and every run with its provenance (:mod:`.tables`), and the
figures (:mod:`.figures`). Nothing on the page is typed in by hand.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from ..report import pipe_table
from .core import ROOT, Family, recorded_files, summarise, without_protocol
from .figures import plot_curves, plot_quality_memory
from .judging import (
    arm_seeds,
    check_seeds,
    comparisons,
    curve_label,
    defined_comparisons,
    label_text,
    not_run,
    power_text,
    still_improving,
    variant_of_role,
)
from .protocol import Protocol, ProtocolError
from .tables import (
    code_label,
    fmt,
    per_run_table,
    reruns_table,
    sample_grids,
    sampler_cost_table,
    trust_table,
    tuning_solves_table,
)

__all__ = ["fmt", "load_units", "write_page"]

FACTS = ("parameters", "activation_memory_mb", "seconds_per_iteration", "solver_iterations", "solver_rel_residual",
         "ift_backward_failures")


def load_units(out: Path, family: Family, protocol: Protocol) -> dict[int, tuple[Protocol, list[dict], int]]:
    """The family's recorded units by design (:meth:`.protocol.Protocol.design_of`), newest first: the design's
    protocol, its units in the family's group and variant order, then by seed, and how many were left out (of
    several settings, e.g. budgets, only the most common are kept: a table never mixes them). A unit of no design
    (an edited protocol file, a later version) or of a seed its design does not list is refused
    (:class:`ProtocolError`, naming the file)."""
    units = []
    for path in recorded_files(out / family.name):
        unit = json.loads(path.read_text())
        if unit["group"] in family.groups and unit["variant"] in family.variants:
            units.append(unit | {"file": str(path)})
    by_design: dict[int, tuple[Protocol, list[dict]]] = {}
    for unit in units:
        design = protocol.design_of(unit)
        if design is None:
            stamp = unit["settings"].get("protocol") or "no protocol"
            raise ProtocolError(
                f"{unit['file']}: not recorded under protocol v{protocol.version} ({protocol.sha256[:12]}) nor under "
                f"an unedited earlier version ({stamp}); a comparison never mixes rules: move it aside or report it "
                "under its own protocol")
        by_design.setdefault(design.version, (design, []))[1].append(unit)
    result = {}
    groups, variants = list(family.groups), list(family.variants)
    for version in sorted(by_design, reverse=True):
        design, members = by_design[version]
        shared = lambda u: json.dumps(without_protocol(u["settings"]), sort_keys=True)  # noqa: E731
        common, _ = Counter(shared(u) for u in members).most_common(1)[0]
        kept = [u for u in members if shared(u) == common]
        check_seeds(design, kept)
        kept.sort(key=lambda u: (groups.index(u["group"]), variants.index(u["variant"]), u["seed"]))
        result[version] = (design, kept, len(members) - len(kept))
    return result


def on_protocol(family: Family, protocol: Protocol, settings: dict) -> bool:
    """Whether units of ``settings`` ran as the protocol says (budget, evaluation, fit options, no extras)."""
    entry = protocol.family(family.name)
    tuned = "learning_rate" not in protocol.text or settings.get("learning_rate") == "tuned"
    return (settings["budget"] == entry["budget"] and settings["evaluation"] == entry["evaluation"]
            and settings["fit"] == entry["fit"] and not settings["extra"] and tuned)


def recorded_under(units: list[dict], design: Protocol) -> str:
    """Which earlier versions the units ran under, where some did (they count: the design governs them alike)."""
    earlier = Counter(u["settings"]["protocol"]["version"] for u in units
                      if u["settings"]["protocol"]["version"] != design.version)
    if not earlier:
        return ""
    return " (" + ", ".join(f"{n} unit{'s' if n > 1 else ''} recorded under v{v}, which governs them alike"
                            for v, n in sorted(earlier.items())) + ")"


def code_of(units: list[dict]) -> str:
    """The commits the units' code came from (``not recorded`` for units that predate the record)."""
    counts = Counter(code_label(u.get("code"), " with uncommitted changes") for u in units)
    return ", ".join(f"{what} ({n} unit{'s' if n > 1 else ''})" for what, n in sorted(counts.items()))


def mean_cell(summary: dict, key: str, digits: int = 3) -> str:
    if key not in summary:
        return "–"
    cell = summary[key]
    stderr = "" if cell["stderr"] is None else f" ± {fmt(cell['stderr'], digits)}"
    return f"{fmt(cell['mean'], digits)}{stderr}"


def seeds_cell(arm: dict) -> str:
    """``counted of expected``, the missing and the excluded seeds named."""
    expected = len(arm["expected"])
    text = f"{len(arm['counted'])} of {expected}"
    if arm["missing"]:
        text += f"; **missing** {', '.join(map(str, arm['missing']))}"
    if arm["excluded"]:
        text += "; **excluded** " + ", ".join(f"{s} ({why})" for s, why in arm["excluded"].items())
    return text


def verdict_cell(c: dict) -> tuple[str, str]:
    """The unadjusted verdict (with the power of an inconclusive one) and Holm's, each marked interim where an
    arm is short of its protocol seeds, and with the devices where its units ran on more than one."""
    test = c["test"]
    marks = ("interim: " if c["interim"] else "") + \
        (f"across devices ({'; '.join(c['devices'])}): " if len(c["devices"]) > 1 else "")
    if test is None:
        why = "margin unknown" if c["margin"] is None else "fewer than two seeds a side"
        return f"**not judged** ({why})", "–"
    power = "" if test.verdict != "inconclusive" else f"; {power_text(test)}"
    return f"{marks}**{test.verdict}**{power}", f"{marks}**{c['holm']}** (m = {c['holm_m']})"


COMPARISON_HEADER = ["data", "comparison", "seeds (DEQ / other)", "d ± se (positive: DEQ better)", "Welch df",
                     "L (95 %)", "supported margin (-L)", "margin", "verdict (before Holm)",
                     "Holm, familywise alpha 0.05", "curves (DEQ; other)", "DEQ memory / other"]


def no_comparison(*front: str, why: str) -> list[str]:
    """A comparison table's row saying why there is no comparison (the summary's with the family and design)."""
    return [*front, "–", why, *[""] * (len(COMPARISON_HEADER) - 2)]


def comparison_row(c: dict) -> list[str]:
    """One row's cells of a comparison table (also the summary's, with the family and design in front)."""
    test = c["test"]
    ratio = "–" if c["memory_ratio"] is None else f"{c['memory_ratio']:.2f}"
    verdict, adjusted = verdict_cell(c)
    curves = "; ".join(label_text(label) for label in c["labels"])
    if still_improving(c):
        curves = "**an arm still improving**: " + curves
    seeds = " / ".join(f"{len(a['counted'])} of {len(a['expected'])}" for a in c["arms"])
    numbers = ["–"] * 4 if test is None else [
        f"{test.d:+.3g} ± {test.se:.2g}", f"{test.df:.1f}", f"{test.lower:+.3g}", f"{test.supported_margin:.3g}"]
    return [c["group"], f"{c['deq']} vs {c['other']} ({c['role']})", seeds, *numbers, fmt(c["margin"]), verdict,
            adjusted, curves, ratio]


def control_sentence(family: Family, design: Protocol, summaries: dict[str, dict]) -> list[str]:
    """The untrained network as a control (never an override of the verdict): each trained variant's metric as a
    fraction of the untrained network's, against the protocol's criterion."""
    untrained, metric = variant_of_role(family, "untrained"), family.control(design)
    base = summaries.get(untrained, {}).get(metric.key, {}).get("mean")
    if not base:
        return []
    ratios = [f"{name} {s[metric.key]['mean'] / base:.2f}" for name, s in summaries.items()
              if name != untrained and metric.key in s]
    criterion = design.family(family.name).get("control", "")
    return [f"Control: each trained variant's {metric.label} as a fraction of the untrained network's "
            f"({fmt(base)}): {', '.join(ratios) or 'no trained run yet'}. {criterion}"]


def arm_table(family: Family, design: Protocol, rules: Protocol, units: list[dict],
              summaries: list[dict]) -> list[str]:
    """Per arm of a data set with units: its protocol seeds (missing and excluded named), the mean and standard
    error over the counted seeds, its validation curve's label and its run facts. Every arm the protocol gives
    seeds has its row, one without a counted unit too (all its seeds missing or excluded), so that no arm leaves
    the page by not running."""
    header = ["data", "variant", "role", "seeds", *(m.label for m in family.metrics), "validation curve",
              "learning rate", "parameters", "activation memory (MiB)", "s / iteration", "solver iterations",
              "IFT misses"]
    rows = []
    rule = rules.family(family.name).get("learning_rate")
    by_arm = {(s["group"], s["variant"]): s for s in summaries}
    groups = dict.fromkeys(u["group"] for u in units)
    for s in [by_arm.get((group, name), {"group": group, "variant": name}) for group in groups
              for name in family.variants if design.seeds(family.name, name)]:
        variant = family.variants[s["variant"]]
        arm = arm_seeds(design, rules, units, family, s["group"], s["variant"])
        params = s.get("parameters", {}).get("mean")
        label = label_text(curve_label(rules, units, s["group"], s["variant"]))
        rates = sorted({a.split("=", 1)[1] for u in arm["counted"] for a in u["value"].get("arguments", [])
                        if rule and a.startswith(f"{rule['option']}=")})
        rates = [rate + edge_of_grid(float(rate), rule["grid"]) for rate in rates] or \
            ["the config's" if arm["counted"] else "–"]
        rows.append([s["group"], s["variant"], variant.role, seeds_cell(arm),
                     *(mean_cell(s, m.key) for m in family.metrics), label, ", ".join(rates),
                     "–" if params is None else f"{params:,.0f}", mean_cell(s, "activation_memory_mb", 2),
                     mean_cell(s, "seconds_per_iteration", 3), mean_cell(s, "solver_iterations", 1),
                     mean_cell(s, "ift_backward_failures", 2)])
    return [*pipe_table(header, rows), "",
            "Mean ± standard error over the counted seeds (excluded ones left out); – where a variant has no such "
            "figure (an explicit network has no solver; the IFT column only where the backward is the IFT). "
            "Activation memory: the tensors one training step saves for backward. s / iteration: wall clock of "
            "`train.py fit` over its iterations, validation and checkpointing included (DKEF: also its closing "
            "stage), on a machine shared with other jobs: a rough figure; the benchmarks measure speed. A learning "
            "rate at an end of its grid may have its best beyond that end.", ""]


def edge_of_grid(rate: float, grid: list[float]) -> str:
    """`` (the grid's largest)`` or `` (the grid's smallest)`` where ``rate`` is one of the grid's ends, else ``""``."""
    return " (the grid's largest)" if rate == max(grid) else " (the grid's smallest)" if rate == min(grid) else ""


def design_section(family: Family, design: Protocol, rules: Protocol, units: list[dict], left_out: int, out: Path,
                   page: Path) -> tuple[list[str], list[list[str]]]:
    """The page's part for the units of one design, judged by ``rules``, and its rows of the summary."""
    rel = lambda p: relative(p, page)  # noqa: E731
    settings = units[0]["settings"]
    newest = design.version == rules.version
    counted = [u for u in units if not arm_seeds(design, rules, units, family, u["group"], u["variant"])[
        "excluded"].get(u["seed"])]
    summaries = summarise(counted, [m.key for m in family.metrics] + list(FACTS))
    memory = {(s["group"], s["variant"]): s.get("activation_memory_mb", {}).get("mean") for s in summaries}
    title = (f"### Protocol v{design.version}" if newest else
             f"### Units of the v{design.version} design, judged by v{rules.version}'s rules")
    lines = [title, "",
             *([] if newest else [f"These units ran under v{design.version}'s training settings, which "
                                  f"v{rules.version} changes; they are judged here by v{rules.version}'s rules "
                                  f"(seeds, log Z, Holm, curve labels) against v{design.version}'s seeds, and "
                                  "never pooled with units of another design.", ""]),
             f"* **budget**: {settings['budget']} x the default, {settings['iterations']:,} training iterations "
             f"per run; evaluation {settings['evaluation'] or 'as configured'}"
             + (f"; extra arguments `{' '.join(settings['extra'])}`" if settings["extra"] else ""),
             f"* **protocol**: v{design.version}" + recorded_under(units, design)
             + ("" if on_protocol(family, design, settings) else
                ", **off-protocol settings** (a trial: not evidence)"),
             f"* **device**: {', '.join(sorted({u['device'] for u in units}))}",
             f"* **code**: {code_of(units)}",
             *([f"* **left out**: {left_out} unit files recorded with other settings"] if left_out else []), "",
             *arm_table(family, design, rules, units, summaries)]
    table, defined = comparisons(family, design, rules, units, memory), len(defined_comparisons(family, design))
    rows = [comparison_row(c) for c in table] or [no_comparison(why="no comparison yet")]
    alpha = rules.text["rule"]["holm"]["alpha"]
    lines += [f"**The verdicts** ({family.judged(design).label}, margin {margin_text(family, design)}; Holm's "
              f"correction over the {defined} comparisons this design defines, "
              f"familywise alpha {alpha}; interim: an arm short of its protocol seeds, not a result; across "
              f"devices: its units ran on more than one device, whose arithmetic differs):", "",
              *pipe_table(COMPARISON_HEADER, rows), ""]
    if missing := not_run(family, design, table):
        lines += [f"**Not run** ({len(missing)} of the {defined} comparisons: an "
                  "arm has no counted unit; each counts in Holm's m): "
                  + "; ".join(f"{group} {deq} vs {other}" for group, deq, other in missing) + ".", ""]
    by_group: dict[str, dict[str, dict]] = {}
    for s in summaries:
        by_group.setdefault(s["group"], {})[s["variant"]] = s
    for group_summaries in by_group.values():
        lines += control_sentence(family, design, group_summaries)
    lines += ["", *reruns_table(family, family.judged(design), units), *trust_table(units, rules),
              *tuning_solves_table(family, design, rules, out / family.name),
              *sampler_cost_table(units), *per_run_table(family, units, rules)]
    figures = out / family.name
    for group in family.groups:
        if any(u["group"] == group for u in units):
            path = figures / f"v{design.version}_curves_{group}.png"
            plot_curves(family, units, group, path)
            lines += [f"![{family.title}, {group}: learning curves]({rel(path)})", ""]
    path = figures / f"v{design.version}_quality_vs_memory.png"
    plot_quality_memory(family, family.judged(design), summaries, path)
    lines += [f"![{family.title}: test metric against memory]({rel(path)})", "", *sample_grids(family, units, rel)]
    return lines, [[family.title, f"v{design.version}", *row] for row in rows]


def family_section(family: Family, designs: dict[int, tuple[Protocol, list[dict], int]], out: Path, page: Path,
                   rules: Protocol) -> tuple[list[str], list[list[str]]]:
    """The page's section of one family (figures written under ``out/<family>/``) and its rows of the summary."""
    lines = [f"## {family.title}", "", family.setting, "",
             f"* **command**: `python -m deqlab study --family {family.name}`",
             *([f"* **context (not comparable)**: {family.context}"] if family.context else []), ""]
    rows = []
    if rules.version not in designs:
        lines += [f"### Protocol v{rules.version}", "", f"No unit recorded under protocol v{rules.version} yet.", ""]
        rows.append(no_comparison(family.title, f"v{rules.version}", why="no units yet"))
    for design, units, left_out in designs.values():
        part, design_rows = design_section(family, design, rules, units, left_out, out, page)
        lines += part
        rows += design_rows
    return lines, rows


def margin_text(family: Family, protocol: Protocol) -> str:
    entry = protocol.family(family.name)
    if "margin" in entry:
        return f"{entry['margin']} {entry['margin_unit']}"
    return f"{entry['margin_relative_to_shallow']:.0%} of the shallow network's mean"


def protocol_section(protocol: Protocol) -> list[str]:
    """The protocol as the file states it: rule, definitions and each family's fixed settings."""
    text, rule = protocol.text, protocol.text["rule"]
    lines = ["## Protocol", "",
             f"Version {protocol.version}: `{rel_to_root(protocol.path)}` (SHA-256 `{protocol.sha256}`), fixed "
             f"{text['fixed']}. Every unit on this page records the version and hash it ran under: this one, or an "
             "earlier version whose file is unedited; such a unit belongs to the newest version that governs it alike "
             "(everything of the protocol but the other families' entries and the other variants' seeds reads the "
             "same) and is judged by this version's rules beside the units of its own design, never pooled with "
             "another design's. The report refuses any other unit, and a change to the file is a new version with "
             "its deviations listed below.", "",
             f"**The question.** {text['question']}", "",
             f"**The rule.** {rule['test']}. At the family's margin: **holds** when {rule['holds']}; **fails** "
             f"when {rule['fails']}; **inconclusive** {rule['inconclusive']}. alpha = {rule['alpha']} one-sided; "
             f"at least {rule['minimum_seeds']} seeds a side. The same test against the deep explicit network. "
             "The supported margin (-L) is the smallest margin at which the comparison would hold.", "",
             *([f"**Holm.** {rule['holm']['how']}; over {rule['holm']['over']}.", ""] if "holm" in rule else []),
             *([f"**Seeds.** {rule['seeds']}.", ""] if "seeds" in rule else []),
             f"**Curves.** {text['curves']['definition'] if 'curves' in text else text['flattened']['definition']}."
             + ("".join(f" **{k}**: {v}." for k, v in text["curves"]["labels"].items()) if "curves" in text else ""),
             "", f"**Trust figures.** {text['trust']['what']}.", "",
             *(f"**{title}.** {text[key]}." if isinstance(text[key], str) else
               f"**{title}.** {text[key]['rule']}; tuning seeds {text[key]['tuning_seeds']}." for key, title in
               (("reproducibility", "Reproducibility"), ("carry_over", "Carry-over"),
                ("learning_rate", "Learning rates")) if key in text), ""]
    rows = []
    for name, entry in text["families"].items():
        notes = "; ".join(entry[k] for k in ("faithful", "implicit", "sampler", "control") if k in entry)
        rate = entry.get("learning_rate")
        if rate:
            notes += f"; learning rate `{rate['option']}` from {rate['grid']} by {rate['validation']}"
        if "log_z" in entry:
            notes += f"; log Z: {entry['log_z']['redraw']}; {entry['log_z']['stderr']}"
        if "price" in entry:
            notes += f"; price: {entry['price']}"
        seeds = ", ".join(f"{v} {n}" for v, n in entry["seeds"].items())
        margin = (f"{entry['margin']} {entry['margin_unit']}" if "margin" in entry else
                  f"{entry['margin_relative_to_shallow']:.0%} of the shallow {entry['margin_unit']}")
        rows.append([name, entry["metric"], "higher" if entry["higher_is_better"] else "lower", margin,
                     f"{entry['budget']} x", seeds, str(entry["evaluation"]), f"`{' '.join(entry['fit'])}`", notes])
    headers = ["family", "metric", "better", "margin", "budget", "seeds", "evaluation", "fit options", "notes"]
    return [*lines, *pipe_table(headers, rows), ""]


def deviations_section(protocol: Protocol) -> list[str]:
    lines = ["## Deviations", "", "Every change to how the study is run or judged, with the version it belongs "
             "to and whether it was made before or after results were seen.", ""]
    rows = [[str(d["version"]), d["seen"], d["change"]] for d in protocol.text["deviations"]]
    return [*lines, *pipe_table(["version", "decided", "change"], rows), ""]


def write_page(out: Path, page: Path, families: list[Family], protocol: Protocol) -> str:
    """``page`` from the unit files under ``out``, judged by ``protocol``; the markdown."""
    sections: list[str] = []
    rows: list[list[str]] = []
    for family in families:
        section, family_rows = family_section(family, load_units(out, family, protocol), out, page, protocol)
        sections += section
        rows += family_rows
    lines = ["# Results: the reproduction study", "",
             "Written by `python -m deqlab study --report` from the unit files under "
             f"`{rel_to_root(out)}/` (one per family, data set, variant and seed); do not edit by hand. Benchmarks of "
             "speed and memory: [benchmarks.md](benchmarks.md).", "",
             "## Summary", "", f"Every comparison's non-inferiority verdict at the protocol's margin, before and "
             f"after Holm's correction over its family's comparisons, the smallest margin the data support, and "
             f"each arm's validation curve, for the units of protocol v{protocol.version} and, after them, the units "
             "of earlier designs judged by its rules. An interim verdict rests on fewer seeds than the protocol's "
             "and is not a result.", "",
             *pipe_table(["family", "design", *COMPARISON_HEADER], rows), "",
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
