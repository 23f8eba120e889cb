"""The study's arms and its rule: per-seed log10 RMSE of two arms by Welch's one-sided bounds at a margin, a
comparison deciding only between unmarked arms (neither still falling nor far above its floor), and the protocol's
directional predictions judged on the comparisons they name. An inconclusive or undecided comparison never bears a
prediction out."""

from __future__ import annotations

import math

from ..report import fmt_value
from ..study.verdict import non_inferiority, seeds_needed
from ..units import mean_stderr
from .training import at_floor


def _mean_cell(values: list[float], spec: str = ".3g") -> str:
    mean, se = mean_stderr(values)
    return fmt_value(mean, spec) + (f" ± {fmt_value(se, '.2g')}" if se is not None else "")


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return mean_stderr(values)[0] if values else None


def summarise_arm(budget: str, dim: int, network: str, runs: list[dict]) -> dict:
    """One arm (network, budget, d) from its test runs (one per seed): the seed means and its marks."""
    metric = mean_stderr([r["metric"] for r in runs])[0]
    floor = runs[0]["floor"]
    trust = [r["trust"] for r in runs if r.get("trust")]
    return {
        "budget": budget, "dim": dim, "network": network, "seeds": len(runs),
        "log10_metric": [math.log10(r["metric"]) for r in runs], "metric": metric,
        "metric_cell": _mean_cell([r["metric"] for r in runs]), "floor": floor,
        "above_floor": metric / floor if floor > 0 else None, "at_floor": at_floor(metric, floor),
        "still_falling": sum(r["still_falling"] for r in runs),
        "marked": sum(r["still_falling"] for r in runs) > 0 or not at_floor(metric, floor),
        "lr": runs[0]["lr"], "steps": runs[0]["steps"], "untrained": _mean([r["metric_untrained"] for r in runs]),
        "control": runs[0]["metric_control"], "slope_cell": _mean_cell([r["largest_slope"] for r in runs]),
        "lipschitz_budget": runs[0]["lipschitz_budget"], "layer_cap": runs[0]["layer_cap"],
        "spectral_product": _mean([r["spectral_product"] for r in runs]),
        "max_spectral": max(r["max_spectral_norm"] for r in runs),
        "recurrent_norm": _mean([r["recurrent_norm"] for r in runs]), "gamma": runs[0]["gamma"],
        "phantom_steps": runs[0]["phantom_steps"], "parameters": runs[0]["parameters"],
        "max_abs": max(r["max_abs_weight"] for r in runs), "solver_iters": _mean([r["solver_iters"] for r in runs]),
        "capped_solves": _mean([r["capped_solves"] for r in runs]),
        "contraction": max(t["contraction"] for t in trust) if trust else None,
        "derivative_error": max(t["derivative_rel_error"] for t in trust) if trust else None,
        "gradient_error": max(t["gradient_rel_error"] for t in trust) if trust else None,
        "cpu_ms_per_step": _mean([r["cpu_ms_per_step"] for r in runs]),
    }


def outcome(a: list[float], b: list[float], margin: float) -> dict | None:
    """The rule on log10 metrics (lower is better): ``d`` = B minus A, one-sided 95 % bounds L and U, and the
    outcome ``a_better`` / ``b_better`` / ``equivalent`` / ``inconclusive``.

    >>> outcome([0.0, 0.01, -0.01], [1.0, 1.01, 0.99], 0.1)["outcome"]
    'a_better'
    >>> outcome([0.0, 0.01, -0.01], [0.0, 0.02, -0.01], 0.1)["outcome"]
    'equivalent'
    """
    test = non_inferiority(a, b, margin, higher_is_better=False)
    if test is None:
        return None
    lower, upper = test.lower, test.upper
    result = ("a_better" if lower > margin else "b_better" if upper < -margin
              else "equivalent" if lower > -margin and upper < margin else "inconclusive")
    needed = seeds_needed(*test.sd, margin) if result == "inconclusive" else None
    return {"d": test.d, "se": test.se, "lower": lower, "upper": upper, "outcome": result, "seeds": test.n,
            "seeds_needed": needed}


def compare(arm_a: dict, arm_b: dict, margin: float) -> dict | None:
    """Arm A against arm B: the outcome, and whether it decides (both arms unmarked)."""
    res = outcome(arm_a["log10_metric"], arm_b["log10_metric"], margin)
    if res is None:
        return None
    return {"dim": arm_a["dim"], "a": f"{arm_a['network']} ({arm_a['budget']})",
            "b": f"{arm_b['network']} ({arm_b['budget']})", **res,
            "decides": not (arm_a["marked"] or arm_b["marked"])}


def comparisons(arms: list[dict], margin: float) -> list[dict]:
    """Every DEQ arm against every feed-forward arm of its budget and d, and the steepening DEQ against the control
    DEQ at each d where they differ."""
    by_key = {(a["budget"], a["dim"], a["network"]): a for a in arms}
    out = []
    for (budget, dim, network), arm in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        if network.startswith("deq"):
            others = [v for (b, d, n), v in by_key.items() if b == budget and d == dim and n.startswith("ffn")]
            if network == "deq_steep" and (control := by_key.get(("control", dim, "deq"))):
                others.insert(0, control)
            out += [c for other in others if (c := compare(arm, other, margin))]
    return out


def judge(predictions: list[dict], arms: list[dict], margin: float) -> list[dict]:
    """Each prediction against the comparisons it names: ``borne out`` when every one decides with an expected
    outcome; ``contradicted`` when one decides with another; ``open`` otherwise (inconclusive, or an arm still
    falling or far above its floor); ``not run`` when an arm is missing."""
    by_key = {(a["budget"], a["dim"], a["network"]): a for a in arms}
    rows = []
    for p in predictions:
        first = by_key.get((p["a"][1], p["dim"], p["a"][0]))
        seconds = [by_key.get((budget, p["dim"], network)) for network, budget in p["b"]]
        hits = [compare(first, b, margin) for b in seconds] if first and all(seconds) else []
        if not hits or None in hits:
            verdict, detail = "not run", "arm(s) missing" if not hits else "too few seeds"
        else:
            ok = [c["outcome"] in p["expected"] for c in hits]
            verdict = ("borne out" if all(o and c["decides"] for o, c in zip(ok, hits, strict=True))
                       else "contradicted" if any(not o and c["decides"] and c["outcome"] != "inconclusive"
                                                  for o, c in zip(ok, hits, strict=True))
                       else "open")
            detail = "; ".join(f"{c['a']} vs {c['b']}: {c['outcome']}" + ("" if c["decides"] else " (undecided: "
                               "an arm still falling or far above its floor)") for c in hits)
        rows.append({"id": p["id"], "text": p["text"], "expected": " or ".join(p["expected"]), "verdict": verdict,
                     "detail": detail})
    return rows
