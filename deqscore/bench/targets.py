"""Pass/fail of the benchmark targets, computed from the measured rows only."""

from __future__ import annotations

from .report import Column, Table
from .settings import MAIN_SOLVER_BLOCK, Settings

FLAT_TOLERANCE = 0.05  # (a) phantom memory spread over the iteration counts
MEMORY_RATIO_MAX = 0.1  # (b) phantom / unroll activation memory at ITERATIONS_B
ITERATIONS_B = 32
FEVAL_RATIO_MAX = 0.5  # (c) Anderson / Picard function evaluations


def _row(target: str, measured: str, value: float | None, passed: bool | None) -> dict:
    return {"target": target, "measured": measured, "value": value, "pass": passed}


def _not_run(target: str, section: str) -> dict:
    return _row(target, f"section {section} not run", None, None)


def _memory_of(table: Table, model: str) -> dict[int, float]:
    return {r["n"]: r["act_mib"] for r in table.rows if r["model"] == model}


def target_flat(tables: dict[str, Table]) -> dict:
    name = f"(a) phantom activation memory flat within {FLAT_TOLERANCE:.0%} over the iteration counts"
    if "memory_vs_iterations" not in tables:
        return _not_run(name, "memory_vs_iterations")
    mem = _memory_of(tables["memory_vs_iterations"], "phantom")
    spread = (max(mem.values()) - min(mem.values())) / min(mem.values())
    measured = ", ".join(f"{v:.2f} MiB at {n}" for n, v in mem.items()) + f"; spread {spread:.2%}"
    return _row(name, measured, spread, spread <= FLAT_TOLERANCE)


def target_ratio(tables: dict[str, Table]) -> dict:
    name = f"(b) at {ITERATIONS_B} iterations phantom <= {MEMORY_RATIO_MAX:g} x unroll activation memory"
    if "memory_vs_iterations" not in tables:
        return _not_run(name, "memory_vs_iterations")
    table = tables["memory_vs_iterations"]
    phantom, unroll = _memory_of(table, "phantom"), _memory_of(table, "unroll")
    if ITERATIONS_B not in phantom or ITERATIONS_B not in unroll:
        return _row(name, f"no rows at {ITERATIONS_B} iterations", None, None)
    ratio = phantom[ITERATIONS_B] / unroll[ITERATIONS_B]
    measured = f"{phantom[ITERATIONS_B]:.2f} / {unroll[ITERATIONS_B]:.2f} MiB = {ratio:.4f}"
    return _row(name, measured, ratio, ratio <= MEMORY_RATIO_MAX)


def target_fevals(tables: dict[str, Table], s: Settings) -> list[dict]:
    """(c) at the reference tolerance on :data:`MAIN_SOLVER_BLOCK` (the target), plus the other tolerances
    and blocks for information."""
    if "solvers" not in tables:
        return [_not_run(f"(c) Anderson <= {FEVAL_RATIO_MAX:g} x Picard function evaluations", "solvers")]
    rows = tables["solvers"].rows
    out = []
    for block in dict.fromkeys(r["block"] for r in rows):
        for tol in dict.fromkeys(r["tolerance"] for r in rows):
            by = {r["solver"]: r for r in rows if r["block"] == block and r["tolerance"] == tol}
            main = block == MAIN_SOLVER_BLOCK and tol == f"{s.sol_tolerances[0][0]} {s.sol_tolerances[0][1]:g}"
            label = "(c)" if main else "(c, extra)"
            name = f"{label} Anderson <= {FEVAL_RATIO_MAX:g} x Picard fevals, {block} block, tol {tol}"
            a, p = by["anderson"], by["picard"]
            ratio = a["fevals"] / p["fevals"]
            conv = a["converged"] and p["converged"]
            measured = f"Anderson {a['fevals']} / Picard {p['fevals']} = {ratio:.2f}"
            measured += "" if conv else " (not converged)"
            out.append(_row(name, measured, ratio, conv and ratio <= FEVAL_RATIO_MAX))
    return out


def targets(tables: dict[str, Table], s: Settings) -> Table:
    table = Table("targets", "Targets", [
        Column("target", "target"), Column("measured", "measured"), Column("pass", "pass"),
    ])
    table.rows = [target_flat(tables), target_ratio(tables), *target_fevals(tables, s)]
    for row in table.rows:
        row["pass"] = {True: "PASS", False: "FAIL", None: "not run"}[row["pass"]]
    table.notes.append("Computed from the measurements above; '(c, extra)' rows are informational.")
    return table
