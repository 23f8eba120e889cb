"""The range checks of the trainer's options, made on the parsed config before anything is built or written.

Lightning checks these options in scattered places: some in the ``Trainer`` constructor, some when ``fit`` starts
(after the run directory holds its config and logs), and some not at all (``accumulate_grad_batches 0`` divides by
zero at the first batch). Here each is one rule, checked at once, and a value outside it is one message naming the
option. The rules are Lightning's own ranges, never narrower: a value Lightning runs with is accepted.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError


def _int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _fraction_or_count(value: Any) -> bool:
    """An int >= 0, or a float in [0, 1] (a fraction), or a whole float > 1 (Lightning takes 2.0 as 2 batches)."""
    if _int(value):
        return value >= 0
    return isinstance(value, float) and (0.0 <= value <= 1.0 or (value > 1.0 and value.is_integer()))


def _devices(value: Any) -> bool:
    if _int(value):
        return value == -1 or value >= 1
    if isinstance(value, str):  # "auto", "-1", a count ("2") or device indices ("0,1", "1,")
        text = value.strip()
        return text in ("auto", "-1") or (re.fullmatch(r"\d+(\s*,\s*\d+)*\s*,?", text) is not None and text != "0")
    if isinstance(value, list | tuple):
        return bool(value) and all(_int(v) and v >= 0 for v in value) and len(set(value)) == len(value)
    return False


#: option -> (accepts the value, what is accepted); None is accepted where Lightning's signature allows it
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_steps": (lambda v: _int(v) and v >= -1, "-1 (no limit) or an int >= 0"),
    "max_epochs": (lambda v: v is None or (_int(v) and v >= -1), "-1 (no limit) or an int >= 0"),
    "min_steps": (lambda v: v is None or (_int(v) and v >= 0), "an int >= 0"),
    "min_epochs": (lambda v: v is None or (_int(v) and v >= 0), "an int >= 0"),
    "accumulate_grad_batches": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "val_check_interval": (
        lambda v: v is None or (_int(v) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0)
        or isinstance(v, str | dict),  # a duration ('DD:HH:MM:SS' or timedelta options): Lightning parses it
        "an int >= 1 (batches), a float in (0, 1] (a fraction of the epoch) or a duration 'DD:HH:MM:SS'"),
    "check_val_every_n_epoch": (lambda v: v is None or (_int(v) and v >= 1), "an int >= 1 or null"),
    "limit_train_batches": (lambda v: v is None or _fraction_or_count(v), "an int >= 0 or a float in [0, 1]"),
    "limit_val_batches": (lambda v: v is None or _fraction_or_count(v), "an int >= 0 or a float in [0, 1]"),
    "limit_test_batches": (lambda v: v is None or _fraction_or_count(v), "an int >= 0 or a float in [0, 1]"),
    "limit_predict_batches": (lambda v: v is None or _fraction_or_count(v), "an int >= 0 or a float in [0, 1]"),
    "overfit_batches": (_fraction_or_count, "an int >= 0 or a float in [0, 1]"),
    "num_sanity_val_steps": (lambda v: v is None or (_int(v) and v >= -1), "-1 (all) or an int >= 0"),
    "log_every_n_steps": (lambda v: v is None or (_int(v) and v >= 0), "an int >= 0"),
    "fast_dev_run": (lambda v: isinstance(v, bool) or (_int(v) and v >= 0), "true, false or an int >= 0"),
    "reload_dataloaders_every_n_epochs": (lambda v: _int(v) and v >= 0, "an int >= 0"),
    "gradient_clip_val": (lambda v: v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool)
                                                  and 0 <= v < float("inf")), "a finite number >= 0"),
    "devices": (_devices, "'auto', -1 (all), an int >= 1, a list of distinct device indices or a string '0,1'"),
    "num_nodes": (lambda v: _int(v) and v >= 1, "an int >= 1"),
}


def check_trainer_options(options: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` naming the first trainer option (``trainer.<name>``) outside its range."""
    for name, (accepts, accepted) in RULES.items():
        if name in options and not accepts(options[name]):
            raise ConfigError(f"trainer.{name} must be {accepted}, got {options[name]!r}")
