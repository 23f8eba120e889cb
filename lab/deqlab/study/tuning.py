"""Each arm's learning rate by the protocol's rule (``learning_rate`` in the protocol and in each family's entry):
the arm is trained at every rate of its family's grid at the tuning seeds (which no judged unit uses), with the
unit's settings and without the test split; the rate whose validation figure is best at the weights the family
evaluates is the arm's (a tie keeps the smaller rate). Tuning runs are recorded, and read back, like units
(``<out>/<family>/<data>/tuning/<variant>_lr<rate>_s<seed>.json``), so a study that stops during tuning
continues there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .core import Family, UnitSettings, run_unit


def validation_figure(unit: dict, rule: dict[str, Any]) -> float:
    """A tuning run's figure: its validation series ``rule['validation']`` at the last validation (``at: last``)
    or at its best (``at: best``, lowest or highest as ``rule['better']`` says)."""
    series = [v for _, v in unit["value"]["validation"].get(rule["validation"], [])]
    if not series:
        raise RuntimeError(f"{unit['family']} {unit['variant']} tuning run logged no {rule['validation']}")
    if rule["at"] == "last":
        return series[-1]
    return min(series) if rule["better"] == "lower" else max(series)


def best_rate(figures: dict[float, list[float]], better: str) -> float:
    """The rate of the best mean figure; a tie keeps the smaller rate."""
    sign = 1.0 if better == "lower" else -1.0
    return min(figures, key=lambda rate: (sign * sum(figures[rate]) / len(figures[rate]), rate))


def rate_of_best_runs(runs_by_rate: dict[float, list[dict]], rule: dict[str, Any]) -> float:
    """The rate whose tuning runs have the best mean validation figure by ``rule`` (:func:`best_rate`)."""
    return best_rate({rate: [validation_figure(run, rule) for run in runs] for rate, runs in runs_by_rate.items()},
                     rule["better"])


def tuned(family: Family, name: str) -> bool:
    """Whether an arm's rate is tuned: every trained variant but another model class (no score network)."""
    variant = family.variants[name]
    return variant.trained and variant.role != "classical"


def tuning_rule(family: Family, name: str, settings: UnitSettings) -> dict[str, Any] | None:
    """The family's learning-rate rule where the arm is tuned; None where the protocol has no rule, the family no
    grid, the settings do not tune, or the arm is not tuned (:func:`tuned`)."""
    rule = settings.protocol.family(family.name).get("learning_rate")
    if settings.learning_rate != "tuned" or rule is None or not tuned(family, name):
        return None
    return rule


def tuning_runs(family: Family, group: str, name: str, rate: float, settings: UnitSettings, runs_root: Path,
                out: Path, facts: dict[str, Any]) -> list[dict]:
    """The arm's tuning runs at one rate of its grid (one per tuning seed), run or read back."""
    option = settings.protocol.family(family.name)["learning_rate"]["option"]
    return [run_unit(family, group, name, seed, settings, runs_root, out, facts, learning_rate=(option, rate),
                     kind="tuning") for seed in settings.protocol.text["learning_rate"]["tuning_seeds"]]


def chosen_rate(family: Family, group: str, name: str, settings: UnitSettings, runs_root: Path, out: Path,
                facts: dict[str, Any]) -> tuple[str, float] | None:
    """(option, rate) of the arm's learning rate, its tuning runs run or read back; None where the arm is not
    tuned (:func:`tuning_rule`)."""
    rule = tuning_rule(family, name, settings)
    if rule is None:
        return None
    runs = {rate: tuning_runs(family, group, name, rate, settings, runs_root, out, facts) for rate in rule["grid"]}
    return rule["option"], rate_of_best_runs(runs, rule)
