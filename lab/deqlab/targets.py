"""Pass/fail of the benchmark targets, computed from the measured rows only."""

from __future__ import annotations

from .report import Column, Table
from .settings import MAIN_SOLVER_BLOCK, Settings

FLAT_TOLERANCE = 0.05  # (a) phantom memory spread over the iteration counts
MEMORY_RATIO_MAX = 0.1  # (b) phantom / unroll activation memory at ITERATIONS_B
ITERATIONS_B = 32
FEVAL_RATIO_MAX = 0.5  # (c) Anderson / Picard function evaluations
DEPTH_FLAT_MAX = 1.05  # (d) DEQ memory at the most over the fewest solver iterations, every family and K
VAE_RATIO_MAX = 1.0  # (e) VAE DEQ / explicit score network: activation memory (and, conv, parameters)
NCSN_V2_RATIO_MAX = 0.4  # (f) NCSN DEQ body / NCSNv2 activation memory
NCSN_SHALLOW_RATIO_MAX = 1.0  # (f) NCSN DEQ body / shallow explicit body activation memory


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


def target_depth_flat(tables: dict[str, Table]) -> dict:
    name = f"(d) every family: DEQ memory at the most / fewest solver iterations <= {DEPTH_FLAT_MAX:g}"
    if "depth" not in tables:
        return _not_run(name, "depth")
    flat = {f"{fam}, {v}": x for fam, vs in tables["depth"].meta["flatness"].items() for v, x in vs.items()}
    worst = max(flat, key=flat.__getitem__)
    return _row(name, f"largest {flat[worst]:.3f} ({worst})", flat[worst], flat[worst] <= DEPTH_FLAT_MAX)


def _step_rows(table: Table, loss: str | None = None) -> dict[str, dict]:
    return {r["model"]: r for r in table.rows if "act_mib" in r and r.get("act_mib") is not None
            and (loss is None or r.get("loss") == loss)}


def target_vae(tables: dict[str, Table]) -> list[dict]:
    names = {"MNIST MLP": f"(e) VAE MLP score net: DEQ / explicit activation memory <= {VAE_RATIO_MAX:g}",
             "conv": f"(e) VAE conv score net: DEQ / explicit activation memory and parameters <= {VAE_RATIO_MAX:g}"}
    if "vae" not in tables:
        return [_not_run(name, "vae") for name in names.values()]
    rows, out = _step_rows(tables["vae"]), []
    for arch, name in names.items():
        deq, explicit = rows[f"{arch}, deq"], rows[f"{arch}, explicit"]
        mem = deq["act_mib"] / explicit["act_mib"]
        params = deq["score_params"] / explicit["score_params"]
        measured = f"memory {mem:.3f}x, parameters {params:.3f}x"
        passed = mem <= VAE_RATIO_MAX and (arch != "conv" or params <= VAE_RATIO_MAX)
        out.append(_row(name, measured, mem, passed))
    return out


def target_ncsn(tables: dict[str, Table]) -> list[dict]:
    name = (f"(f) NCSN body at 32x32 ({{}}): DEQ / NCSNv2 <= {NCSN_V2_RATIO_MAX:g} and DEQ / shallow <= "
            f"{NCSN_SHALLOW_RATIO_MAX:g} activation memory")
    if "ncsn" not in tables:
        return [_not_run(name.format("every loss"), "ncsn")]
    out = []
    for loss in dict.fromkeys(r["loss"] for r in tables["ncsn"].rows if r.get("loss")):
        rows = _step_rows(tables["ncsn"], loss)
        deq, v2, shallow = rows["DEQ, phantom"], rows["NCSNv2"], rows["shallow explicit"]
        to_v2, to_shallow = deq["act_mib"] / v2["act_mib"], deq["act_mib"] / shallow["act_mib"]
        out.append(_row(name.format(loss), f"{to_v2:.3f}x NCSNv2, {to_shallow:.3f}x shallow", to_v2,
                        to_v2 <= NCSN_V2_RATIO_MAX and to_shallow <= NCSN_SHALLOW_RATIO_MAX))
    return out


def targets(tables: dict[str, Table], s: Settings) -> Table:
    table = Table("targets", "Targets", [
        Column("target", "target"), Column("measured", "measured"), Column("pass", "pass"),
    ])
    table.rows = [target_flat(tables), target_ratio(tables), *target_fevals(tables, s), target_depth_flat(tables),
                  *target_vae(tables), *target_ncsn(tables)]
    for row in table.rows:
        row["pass"] = {True: "PASS", False: "FAIL", None: "not run"}[row["pass"]]
    table.notes.append("Computed from the measurements above; '(c, extra)' rows are informational.")
    return table
