"""The study's summary rows and its rule: the DEQ against each feed-forward network on log10 metrics, and the
protocol's predictions judged by the comparisons they name."""

from __future__ import annotations

import math

from ..report import fmt_value
from ..study.verdict import non_inferiority, seeds_needed
from ..units import mean_stderr


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
    needed = seeds_needed(*test.sd, margin) if result == "inconclusive" else None
    return {"d": test.d, "se": test.se, "df": test.df, "lower": lower, "upper": upper, "outcome": result,
            "seeds": test.n, "seeds_needed": needed}


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


