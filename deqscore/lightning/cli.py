"""``python train.py``: a LightningCLI for every deqscore model family.

Runs live in ``<runs_root>/<run_name>/`` (default ``checkpoints/<run_name>/``): ``config.yaml`` (the full
resolved config), ``metrics.csv`` (and TensorBoard events when installed), ``checkpoints/*.ckpt``, sample
grids and learning curves. Resuming needs only that directory::

    python train.py fit --config checkpoints/RUN/config.yaml --ckpt_path checkpoints/RUN/checkpoints/last.ckpt
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from jsonargparse import Namespace
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

from .base import ScoreModule


def _logger_config(runs_root: str, run_name: str) -> list[Namespace]:
    """CSV always, TensorBoard when installed; version "" so the log dir is exactly the run dir."""
    args = {"save_dir": runs_root, "name": run_name, "version": ""}
    loggers = [Namespace(class_path="deqscore.lightning.loggers.ResumableCSVLogger", init_args=Namespace(**args))]
    if importlib.util.find_spec("tensorboard") is not None:
        loggers.append(
            Namespace(class_path="pytorch_lightning.loggers.TensorBoardLogger", init_args=Namespace(**args))
        )
    return loggers


def keep_previous_metrics(run_dir: Path) -> Path | None:
    """A fresh (not resumed) fit in an existing run directory starts a new ``metrics.csv``; the old one is
    renamed ``metrics.<n>.csv`` rather than deleted. (A resumed fit appends to it instead.)"""
    old = run_dir / "metrics.csv"
    if not old.is_file():
        return None
    n = 1
    while (run_dir / f"metrics.{n}.csv").exists():
        n += 1
    return old.rename(run_dir / f"metrics.{n}.csv")


class DeqscoreCLI(LightningCLI):
    """LightningCLI with a run name/directory and gradients enabled in evaluation."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # re-running in a run dir must not abort
        trainer_defaults = {"inference_mode": False}  # score matching takes input gradients in val/test
        trainer_defaults.update(kwargs.pop("trainer_defaults", {}) or {})
        super().__init__(
            ScoreModule, *args, subclass_mode_model=True, subclass_mode_data=True,
            trainer_defaults=trainer_defaults, **kwargs,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_name", type=str, default="run", help="name of the run directory")
        parser.add_argument("--runs_root", type=str, default="checkpoints", help="folder holding run directories")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if cfg.trainer.logger in (None, True):
            cfg.trainer.logger = _logger_config(cfg.runs_root, cfg.run_name)
        run_dir = Path(cfg.runs_root) / cfg.run_name
        cfg.trainer.default_root_dir = str(run_dir)
        if self.subcommand == "fit" and not cfg.get("ckpt_path") and os.environ.get("LOCAL_RANK", "0") == "0":
            keep_previous_metrics(run_dir)
        if cfg.trainer.inference_mode:
            raise ValueError("trainer.inference_mode must be false: score matching needs input gradients")


def main(args: list[str] | None = None) -> DeqscoreCLI:
    """Entry point of ``train.py``."""
    # Importing the families registers them as subclasses of ScoreModule for class_path lookup.
    from . import nice  # noqa: F401

    return DeqscoreCLI(args=args)
