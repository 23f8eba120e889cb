"""``python train.py``: a LightningCLI for every deqscore model family.

Runs live in ``<runs_root>/<run_name>/`` (default ``checkpoints/<run_name>/``): ``config.yaml`` (the full
resolved config), ``metrics.csv`` (and TensorBoard events when installed), ``checkpoints/*.ckpt``, sample
grids and learning curves. Resuming needs only that directory::

    python train.py fit --config checkpoints/RUN/config.yaml --ckpt_path checkpoints/RUN/checkpoints/last.ckpt
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from jsonargparse import Namespace
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

from ..errors import ConfigError
from .base import CheckpointFamilyError, ScoreModule
from .checkpoint import read_checkpoint

OPTIMIZER_HINT = "any torch.optim optimizer by class name or class_path, e.g. Adam, AdamW, SGD, RMSprop"
LR_SCHEDULER_HINT = "any torch.optim.lr_scheduler class by name or class_path, e.g. StepLR, CosineAnnealingLR"


class UsageError(SystemExit):
    """A usage mistake reported as one message (exit status 2)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


def usage_error(message: str) -> NoReturn:
    """Print ``error: <message>`` to stderr and exit with status 2 (no traceback)."""
    prog = Path(sys.argv[0]).name or "train.py"
    sys.stderr.write(f"{prog}: error: {message.rstrip()}\n")
    raise UsageError(message)


def condense_parser_error(message: str) -> str:
    """Reduce jsonargparse's nested report to ``key: what is wrong`` plus the accepted values.

    jsonargparse reports a bad value deep inside a ``class_path`` config as a tree of every type it tried; the
    key path, the innermost complaint, the given value and the accepted choices are what a user needs.
    """
    keys = re.findall(r'Parser key "([^"]+)"', message)
    givens = re.findall(r"Given value: (.+)", message)
    if not keys:
        return message
    outer = re.search(r"NestedArg\(key='([^']+)', val='([^']*)'\)", givens[-1]) if givens else None
    subclass = "Problem with given class_path" in message
    key = f"{keys[0]}{'.init_args' if subclass else ''}.{outer.group(1)}" if outer else ".".join(keys)
    inner = re.search(r"NestedArg\(key='([^']+)', val='([^']*)'\)", givens[0]) if givens else None
    if inner and inner is not outer and "Expected a dot import path string" in message:
        parent = key[: -len(inner.group(1)) - 1]  # an option of an object the config names by a short name
        return (f"{parent}: cannot set {inner.group(1)}={inner.group(2)!r} on a short name; give {parent} as a "
                f"class_path first (e.g. --{parent} SomeClass --{parent}.{inner.group(1)} VALUE)")
    ignored = ("Expected a <class 'NoneType'>", "Expected a dot import path string", "Expected a path but")
    lines = [ln.strip().lstrip("- ") for ln in message.splitlines()]
    leaves = [ln for ln in lines if re.match(r"(Expected a|Option '|.*Got value)", ln) and not ln.startswith(ignored)]
    literals = [m for ln in leaves if (m := re.match(r"Expected a typing\.Literal\[(.+)\]", ln))]
    # the literal that saw the value is the innermost complaint; the others are the alternatives tried above it
    literal = next((m for m in literals if "Got value" in m.string), literals[0] if literals else None)
    if literal:
        got = re.search(r"Got value: (.+?)(?:\. Got value:|$)", literal.string)
        value = got.group(1) if got else (outer.group(2) if outer else givens[0] if givens else "?")
        subtypes = re.search(r"Subtypes: \[(typing\.Literal.+)\]", message)
        classes = [c.rsplit(".", 1)[-1] for c in re.findall(r"<class '([\w.]+)'>", subtypes.group(1) if subtypes
                   and literal.group(1).split("]")[0] in subtypes.group(1) else "")
                   if not c.endswith(("NoneType", "ScoreModule", "LightningDataModule"))]
        accepted = literal.group(1).split("]. Got")[0]
        accepted += f", or a class_path of a {' / '.join(classes)} subclass" if classes else ""
        return f"{key}: {value!r} is not accepted\n  accepted: {accepted}"
    if leaves:
        return f"{key}: {leaves[0]}"
    return f"{key}: {givens[0]!r} is not accepted" if givens else message


class DeqscoreArgumentParser(LightningArgumentParser):
    """Reports a bad value as one message naming the key and the accepted values, without the usage text."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # inner parsers: let the outer one report
            return super().error(message, ex)
        message = condense_parser_error(message)
        if 'optimizer' in message.split(":")[0]:
            message += f"\n  accepted: {OPTIMIZER_HINT}"
        if 'lr_scheduler' in message.split(":")[0]:
            message += f"\n  accepted: {LR_SCHEDULER_HINT}"
        usage_error(message + "\n(see --help for every option)")


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
            trainer_defaults=trainer_defaults, parser_class=DeqscoreArgumentParser, **kwargs,
        )

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as err:  # jsonargparse may wrap a constructor's ConfigError; report that one line
            config_error = next((e for e in _chain(err) if isinstance(e, ConfigError)), None)
            if config_error is None:
                raise
            usage_error(str(config_error))

    def _parse_ckpt_path(self) -> None:
        # Lightning reads the checkpoint's hyper-parameters here: a missing, foreign or corrupt file is reported
        # first, as a usage error
        cfg = self.config.get(str(self.config.get("subcommand")), self.config)
        if cfg.get("ckpt_path"):
            _check_checkpoint(cfg.ckpt_path, cfg.model.class_path)
        super()._parse_ckpt_path()

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        # ScoreModule.configure_optimizers only reports a missing `optimizer:`; replacing it is the normal case
        own = type(self.model).configure_optimizers is not ScoreModule.configure_optimizers
        with warnings.catch_warnings():
            if not own:
                warnings.filterwarnings("ignore", message=".*configure_optimizers` will be overridden")
            super()._add_configure_optimizers_method_to_model(subcommand)

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
            usage_error("trainer.inference_mode must be false: score matching needs input gradients")


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes/contexts, outermost first."""
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def _check_checkpoint(path: str, class_path: str) -> None:
    """A usage error unless ``path`` is a readable deqscore checkpoint of the configured model's family."""
    try:
        ckpt = read_checkpoint(path)
    except (FileNotFoundError, CheckpointFamilyError) as err:
        usage_error(f"ckpt_path: {err}")
    module, _, name = class_path.rpartition(".")
    family = getattr(getattr(sys.modules.get(module), name, None), "family", None)
    if family and ckpt.get("deqscore_family") != family:
        usage_error(f"ckpt_path: {path} holds a {ckpt.get('deqscore_family')!r} model, but the config's model is "
                    f"{class_path} (family {family!r})")


def main(args: list[str] | None = None) -> DeqscoreCLI:
    """Entry point of ``train.py``."""
    # Importing the families registers them as subclasses of ScoreModule for class_path lookup.
    from . import nice  # noqa: F401

    return DeqscoreCLI(args=args)


def run(args: list[str] | None = None) -> int:
    """``train.py``: :func:`main`, with usage mistakes reported as one message and exit status 2."""
    try:
        main(args)
    except UsageError as err:
        return err.code
    except ConfigError as err:  # an option found wrong after parsing (e.g. no optimizer configured)
        try:
            usage_error(str(err))
        except UsageError as usage:
            return usage.code
    return 0
