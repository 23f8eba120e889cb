"""The protocol's judging rules, applied to recorded units (:mod:`.report` writes what they decide):

* **seeds**: each variant counts exactly its protocol seeds ``0 .. n-1``; a unit of another seed or of a variant
  without seeds is refused by name (:func:`check_seeds`), a missing seed is listed (:func:`arm_seeds`);
* **log Z** (DKEF): a unit whose importance sampler kept fewer effective draws than the protocol's minimum is
  excluded from its arm's verdict (:func:`exclusion`), and each unit's log Z standard error enters the comparison;
* **comparisons**: every DEQ variant against the shallow and the deep explicit networks by the non-inferiority
  test (:mod:`.verdict`), interim where an arm is short of its protocol seeds, then Holm's correction over the
  family's comparisons, whose number the protocol fixes (:func:`defined_comparisons`, :func:`apply_holm`);
* **curves**: each arm labelled flat, still improving or worsening from its mean validation curve, with the step
  of its best validation (:func:`curve_label`).

``design`` is the protocol whose seeds and settings the units ran under (a unit of an earlier design keeps its
own); ``rules`` the protocol whose judging rules apply (the newest).
"""

from __future__ import annotations

from typing import Any

from .core import Family, seed_curve, value_of
from .protocol import Protocol, ProtocolError
from .verdict import ALPHA, holm, non_inferiority

DEQ_ROLES = ("deq", "deq_faithful", "deq_implicit")  # the networks the claim is about
AGAINST = ("shallow", "deep")


def variant_of_role(family: Family, role: str) -> str | None:
    return next((name for name, v in family.variants.items() if v.role == role), None)


def check_seeds(design: Protocol, units: list[dict]) -> None:
    """Refuse, by file, a unit whose seed is not among its variant's protocol seeds (an extra seed would move a
    verdict as surely as a deleted one), and a second unit of one data set, variant and seed (a copy kept among
    another design's units, :func:`.core.keep_earlier`)."""
    first: dict[tuple, str] = {}
    for u in units:
        name = u.get("file", u["variant"])
        other = first.setdefault((u["group"], u["variant"], u["seed"]), name)
        if other != name:
            raise ProtocolError(f"{name}: a second unit of {u['family']}/{u['group']}/{u['variant']} seed "
                                f"{u['seed']} under protocol v{design.version}, beside {other}; keep one")
    foreign = [u for u in units if u["seed"] not in design.seeds(u["family"], u["variant"])]
    if foreign:
        u = foreign[0]
        seeds = design.seeds(u["family"], u["variant"])
        allowed = f"seeds 0 .. {len(seeds) - 1}" if seeds else "no seeds"
        raise ProtocolError(
            f"{u.get('file', u['variant'])}: seed {u['seed']} of {u['family']}/{u['group']}/{u['variant']} is not a "
            f"seed of protocol v{design.version} ({allowed} for {u['variant']}); "
            f"{len(foreign)} such unit file(s): move them out of the results folder")


def exclusion(rules: Protocol, family: str, unit: dict) -> str | None:
    """Why ``unit`` is left out of its arm's verdict (its log Z rests on too few effective draws), or None."""
    minimum = rules.family(family)["evaluation"].get("log_z_ess_min")
    ess = value_of(unit, "log_z_ess")
    if minimum is None or ess is None or ess >= minimum:
        return None
    return f"log Z ESS {ess:.3g} < {minimum}"


def arm_seeds(design: Protocol, rules: Protocol, units: list[dict], family: Family, group: str,
              variant: str) -> dict[str, Any]:
    """One arm's seeds: expected (the protocol's), counted, missing, and excluded with the reason."""
    expected = design.seeds(family.name, variant)
    present = {u["seed"]: u for u in units if (u["group"], u["variant"]) == (group, variant)}
    excluded = {s: why for s, u in present.items() if (why := exclusion(rules, family.name, u))}
    return {"expected": expected, "missing": [s for s in expected if s not in present], "excluded": excluded,
            "counted": [present[s] for s in expected if s in present and s not in excluded]}


def curve_label(rules: Protocol, units: list[dict], group: str, variant: str | None) -> dict[str, Any] | None:
    """The arm's label from its mean validation curve (protocol ``curves``): ``label``, ``best_step``, ``change``
    (the fall over the last fifth as a fraction of the scale, positive: improving), ``above_best`` (the last
    validation above the best, same scale) and ``cut`` (seed -> last step of a log that ends before the arm's last
    validation: left out); None without two common validation points."""
    rule = rules.text["curves"]
    arm = [u for u in units if (u["group"], u["variant"]) == (group, variant)]
    ends = {u["seed"]: u["value"]["curves"]["val/loss"][-1][0] for u in arm
            if u["value"].get("iterations") and u["value"].get("curves", {}).get("val/loss")}
    # a log that stops short of the arm's last validation (rows a resume dropped) would cut every seed's curve
    # there: it is left out of the label, and named
    last_validation = max(ends.values(), default=None)
    cut = {seed: end for seed, end in ends.items() if end < last_validation}
    curve = seed_curve([u["value"] for u in arm if u["seed"] not in cut], "val/loss")
    if len(curve) < 2:
        return None
    mean = {t: m for t, (m, _) in curve.items()}
    steps = list(mean)
    last = steps[-1]
    best = min(steps, key=lambda t: mean[t])
    scale = max(abs(mean[best]), 1e-30)
    earlier = min(steps[:-1], key=lambda t: abs(t - (1 - rule["window"]) * last))
    change = (mean[earlier] - mean[last]) / scale
    above_best = (mean[last] - mean[best]) / scale
    if above_best > rule["below"]:
        label = "worsening"
    elif change > rule["below"]:
        label = "still improving"
    else:
        label = "flat"
    return {"label": label, "best_step": best, "last_step": last, "change": change, "above_best": above_best,
            "cut": cut}


def label_text(label: dict | None) -> str:
    if label is None:
        return "no curve"
    what = {"worsening": f"{label['above_best']:+.1%} above its best",
            "still improving": f"{label['change']:+.1%} over the last fifth",
            "flat": f"{label['change']:+.1%} over the last fifth"}[label["label"]]
    cut = "".join(f"; seed {seed}'s log ends at step {end:,}, left out" for seed, end in label["cut"].items())
    return f"{label['label']} ({what}; best at step {label['best_step']:,} of {label['last_step']:,}{cut})"


def defined_comparisons(family: Family, design: Protocol) -> list[tuple[str, str, str]]:
    """(group, DEQ variant, other variant) of every comparison the protocol defines for ``family``: Holm's m."""
    others = [v for role in AGAINST if (v := variant_of_role(family, role)) and design.seeds(family.name, v)]
    deqs = [n for n, v in family.variants.items() if v.role in DEQ_ROLES and design.seeds(family.name, n)]
    return [(group, deq, other) for group in family.groups for deq in deqs for other in others]


def comparisons(family: Family, design: Protocol, rules: Protocol, units: list[dict],
                memory: dict[tuple[str, str], float | None]) -> list[dict]:
    """Every defined comparison that has units on both sides: the test at the protocol's margin (None with fewer
    than two counted seeds a side), interim where an arm is short of its seeds, the devices its units ran on (a
    comparison across devices is marked: their arithmetic differs), each arm's curve label, the DEQ's
    activation memory as a fraction of the other's; Holm's verdicts added (:func:`apply_holm`)."""
    metric = family.judged(design)
    alpha = rules.text["rule"].get("holm", {}).get("alpha", ALPHA)
    with_error = "log_z" in rules.family(family.name)
    shallow = variant_of_role(family, "shallow")
    out = []
    for group, deq, other in defined_comparisons(family, design):
        arms = [arm_seeds(design, rules, units, family, group, v) for v in (deq, other)]
        if not all(a["counted"] for a in arms):
            continue
        values = [[value_of(u, metric.key) for u in a["counted"]] for a in arms]
        errors = [[value_of(u, "log_z_stderr") or 0.0 for u in a["counted"]] if with_error else [] for a in arms]
        shallow_values = [value_of(u, metric.key) for u in units if (u["group"], u["variant"]) == (group, shallow)]
        margin = design.margin(family.name, sum(shallow_values) / len(shallow_values) if shallow_values else None)
        test = None if margin is None else non_inferiority(values[0], values[1], margin, metric.higher_is_better,
                                                           alpha, tuple(errors))
        ratio = memory.get((group, deq)), memory.get((group, other))
        out.append({"group": group, "deq": deq, "other": other, "role": family.variants[other].role, "test": test,
                    "margin": margin, "arms": arms, "interim": any(a["missing"] for a in arms),
                    "devices": sorted({u["device"] for a in arms for u in a["counted"]}),
                    "labels": [curve_label(rules, units, group, v) for v in (deq, other)],
                    "memory_ratio": ratio[0] / ratio[1] if all(ratio) else None})
    apply_holm(out, len(defined_comparisons(family, design)), alpha)
    return out


def not_run(family: Family, design: Protocol, judged: list[dict]) -> list[tuple[str, str, str]]:
    """The defined comparisons (:func:`defined_comparisons`) missing from ``judged`` (:func:`comparisons`): an arm
    has no counted unit. They count in Holm's m all the same: the protocol fixed m before any unit ran."""
    ran = {(c["group"], c["deq"], c["other"]) for c in judged}
    return [c for c in defined_comparisons(family, design) if c not in ran]


def apply_holm(comparisons: list[dict], m: int, alpha: float = ALPHA) -> None:
    """Each comparison's verdict after Holm's correction over the family's ``m`` comparisons, for the 'holds' and
    the 'fails' claims alike (``holm``: holds, fails or inconclusive; None without a test)."""
    tests = [c["test"] for c in comparisons]
    holds = holm([t.p_holds if t else None for t in tests], m, alpha)
    fails = holm([t.p_fails if t else None for t in tests], m, alpha)
    for c, h, f in zip(comparisons, holds, fails, strict=True):
        c["holm"] = None if c["test"] is None else "holds" if h else "fails" if f else "inconclusive"
        c["holm_m"] = m


def still_improving(comparison: dict) -> bool:
    return any(label and label["label"] == "still improving" for label in comparison["labels"])


def power_text(test) -> str:
    """An inconclusive test's power, worded as what it is."""
    equal, observed = test.chance_to_hold(0.0), test.chance_to_hold(test.d)
    needed = test.seeds_needed
    more = (f"; {needed} seeds per arm give an 80 % chance to hold if the two were equal" if needed else
            "; more than 1,000 seeds per arm would be needed for an 80 % chance to hold if the two were equal")
    return (f"{equal:.0%} chance to hold with these seeds if the two were equal, {observed:.0%} if the true "
            f"difference were the observed one{more}")


