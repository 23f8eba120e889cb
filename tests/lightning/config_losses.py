"""Every config's first two optimiser steps, recorded: the training metrics logged (losses, and the DEQ's
iteration counts; not its residuals, differences of nearly equal numbers that move with the order of a sum) when a
config, shrunk by its family's tiny overrides, trains for two steps from its fixed seed. ``config_losses.json``
holds them as recorded before the configs were composed from bases (written out in full, at commit a660b18);
``test_families.py`` checks that every config still logs them.

To record a new config's, or every config's anew after a deliberate change of their options (say why in the
commit)::

    python -m tests.lightning.config_losses [--all]
"""

from __future__ import annotations

import csv
import json
import sys
import tempfile
from pathlib import Path

RECORDED = Path(__file__).with_name("config_losses.json")
#: two optimiser steps (two epochs: the tiny image sets hold one batch), one validation batch in between
TWO_STEPS = ("--trainer.max_steps", "2", "--trainer.max_epochs", "2", "--trainer.limit_val_batches", "1")


def logged_training(run_dir: Path) -> list[dict[str, float]]:
    """The training metrics (``train/*``, residuals left out) of each logged step of the run in ``run_dir``."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [{k: float(v) for k, v in row.items() if k.startswith("train/") and not k.endswith("residual") and v}
                for row in csv.DictReader(f)]
    return [row for row in rows if row]


def recorded() -> dict[str, list[dict[str, float]]]:
    """config (relative to the repository) -> its recorded training metrics."""
    return json.loads(RECORDED.read_text())


def record(every: bool = False) -> None:
    """Record the configs not yet recorded (``every``: all of them)."""
    from deqscore.cli.train import main

    from .conftest import CONFIGS, ROOT, tiny_args

    out = {} if every or not RECORDED.exists() else recorded()
    for config in CONFIGS:
        if config.relative_to(ROOT).as_posix() in out:
            continue
        runs = Path(tempfile.mkdtemp())
        main(["fit", *tiny_args(runs, config, "r"), *TWO_STEPS])
        out[config.relative_to(ROOT).as_posix()] = logged_training(runs / "r")
    RECORDED.write_text(json.dumps(dict(sorted(out.items())), indent=1) + "\n")


if __name__ == "__main__":
    record(every="--all" in sys.argv[1:])
