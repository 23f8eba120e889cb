"""``python train.py``: a LightningCLI for every deqscore model family.

Runs live in ``<runs_root>/<run_name>/`` (default ``checkpoints/<run_name>/``): ``config.yaml`` (the full
resolved config), ``metrics.csv`` (and TensorBoard events when installed), ``checkpoints/*.ckpt``, sample
grids and learning curves. Resuming needs only that directory::

    python train.py fit --config checkpoints/RUN/config.yaml --ckpt_path checkpoints/RUN/checkpoints/last.ckpt
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import math
import os
import signal
import sys
import warnings
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from ..configfiles import ConfigFileError, composed_command_line, named_callback_options
from ..errors import ConfigError
from ..lightning.base import ScoreModule, family_registry
from ..lightning.callbacks import ConfiguredOptimizerOptions, Preempted, SaveOnInterrupt
from ..lightning.nonfinite import NonFiniteLossError
from ..lightning.runs import (
    RUN_ID_KEY,
    AtomicCheckpointIO,
    RunIdentity,
    RunLock,
    check_checkpoint_dirpath,
    check_writable_run_dir,
    checkpoint_log_step,
    checkpoint_run_dir,
    holds_a_run,
    move_aside,
    prepare_fresh_run,
    resume_checkpoint,
    run_id,
    truncate_log_after,
)
from ..privates import LightningCLIHooks, give_ranks_time_to_report, set_process_group_timeout
from .checkpoints import check_checkpoint, checkpoint_conflicts, place_in_checkpoint_run
from .errors import USAGE_ERRORS, UsageError, print_error, usage_error
from .parser_errors import explain_refusal
from .ranks import LostRankError, is_lost_peer, leave_process_group, lost_rank_message, parent_lost
from .signals import StopSignals
from .trainer_options import check_trainer_options

PROCESS_GROUP_TIMEOUT_S = 1800.0  # Lightning's and torch's default for gloo: a slow rank is not a lost one


def _logger_config(runs_root: str, run_name: str) -> list[Namespace]:
    """CSV always, TensorBoard when installed; version "" so the log dir is exactly the run dir."""
    args = {"save_dir": runs_root, "name": run_name, "version": ""}
    loggers = [Namespace(class_path="deqscore.lightning.loggers.ResumableCSVLogger", init_args=Namespace(**args))]
    if importlib.util.find_spec("tensorboard") is not None:
        loggers.append(
            Namespace(class_path="pytorch_lightning.loggers.TensorBoardLogger", init_args=Namespace(**args))
        )
    return loggers


def _add_loggers(given: Any, runs_root: str, run_name: str) -> list[Namespace]:
    """The run's CSV log (and TensorBoard when installed), always in this run's directory, with the loggers the
    config or command line gives added beside them, not instead; a given TensorBoard logger keeps its own options
    but writes into the run directory too. A logger list recorded in a run's config.yaml adds up to itself."""
    defaults = _logger_config(runs_root, run_name)
    extra = [] if given in (None, True) else list(given) if isinstance(given, list) else [given]
    out = list(defaults)
    for logger in extra:
        class_path = logger.get("class_path") if isinstance(logger, Namespace | dict) else None
        mine = next((i for i, d in enumerate(defaults) if d.class_path == class_path), None)
        if mine is None:
            out.append(logger)
        elif class_path.endswith("TensorBoardLogger"):  # their options, in the run directory
            init = dict(logger.get("init_args") or {}) | dict(defaults[mine].init_args)
            out[mine] = Namespace(class_path=class_path, init_args=Namespace(**init))
    return out


def launch_rank() -> int:
    """This process's global rank as its launcher set it, before any process group exists (0 when launched
    alone): torchrun's ``RANK``, SLURM's ``SLURM_PROCID``, or ``NODE_RANK`` with ``LOCAL_RANK`` (Lightning's own
    launcher and manual multi-node launches); non-zero for every process but the first of the first node."""
    for variable in ("RANK", "SLURM_PROCID"):
        if variable in os.environ:
            return int(os.environ[variable])
    node, local = int(os.environ.get("NODE_RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    return 0 if node == local == 0 else 1 + node * 1000 + local


def compose_config_files(argv: list[str]) -> list[str]:
    """``argv`` with every ``--config`` file that composes (names a base or names its callbacks) replaced by its
    composed options, named callbacks composed across the files in their order (:mod:`deqscore.configfiles`); a file
    that is empty, not a mapping of options or names a missing base is a usage error naming the file (the parser's
    own message, "Unexpected config", names none)."""
    given = []  # (place in argv, path, whether given as --config=PATH)
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            given.append((i + 1, argv[i + 1], False))
        elif isinstance(arg, str) and arg.startswith("--config="):
            given.append((i, arg.split("=", 1)[1], True))
    given = [g for g in given if Path(g[1]).is_file()]  # a missing file is left to the parser, which names it
    try:
        texts, callbacks = composed_command_line([path for _, path, _ in given])
    except ConfigFileError as err:
        usage_error(f"--config {err}")
    out = list(argv)
    for (i, _, joined), text in zip(given, texts, strict=True):
        if text is not None:
            out[i] = f"--config={text}" if joined else text
    out, overlay = named_callback_options(out, callbacks)
    # after every file, as the last config: the named callbacks with the command line's options set
    return out if overlay is None else [*out, "--config", overlay]


class DeqscoreCLI(LightningCLIHooks):
    """LightningCLI with a run name/directory and gradients enabled in evaluation."""

    def __init__(self, *args, stop_signals: StopSignals | None = None, **kwargs):
        self._stop_signals = stop_signals  # the command's signal handler outside training (run() gives it)
        given = kwargs.get("args")
        self._argv = compose_config_files(list(given if given is not None else sys.argv[1:]))
        kwargs["args"] = self._argv  # the command line with composed configs in place of their files
        self._launcher_pid = os.getppid()  # a DDP worker whose launcher (rank 0) dies gets another parent
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # re-running in a run dir must not abort
        trainer_defaults = {"inference_mode": False}  # score matching takes input gradients in val/test
        trainer_defaults.update(kwargs.pop("trainer_defaults", {}) or {})
        with warnings.catch_warnings():  # args is the command line itself here, not a second one
            warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")
            super().__init__(
                ScoreModule, *args, subclass_mode_model=True, subclass_mode_data=True,
                trainer_defaults=trainer_defaults, **kwargs,
            )

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # the main parser's and every subcommand's: a refusal raises, to be told as one message (parse_arguments)
        return super().init_parser(**{"exit_on_error": False, **kwargs})

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            usage_error(explain_refusal(parser, list(self._argv), str(err)) + "\n(see --help for every option)")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as err:  # jsonargparse wraps a constructor's error as the cause of its own; one line
            known = next((e for e in _chain(err) if isinstance(e, USAGE_ERRORS)), None)
            if known is None:
                raise  # unexpected: keeps its traceback
            option = self._option_of(known)
            usage_error(f"{option}: {known}" if option else str(known))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as err:
            # the constructor's own checks of its options (check_trainer_options covers the ranges; this, the rest:
            # a GPU asked for where there is none, options that exclude each other); any other error is a bug
            if not _is_trainer_option_error(err):
                raise
            usage_error(f"trainer: {str(err).strip()}")

    def _subcommand_config(self) -> Namespace:
        """The parsed options of the subcommand being run (the whole config when there is none)."""
        return self.config.get(str(self.config.get("subcommand")), self.config)

    def _groups(self) -> dict[str, dict[str, Any]]:
        """The data module's and the model's own options, by group."""
        cfg = self._subcommand_config()
        return {group: cfg[group].init_args.as_dict() for group in ("data", "model")
                if isinstance(cfg.get(group), Namespace) and cfg[group].get("init_args") is not None}

    def _option_of(self, error: Exception) -> str | None:
        """The command-line option of the argument an error names (its ``key``) among the data module's and the
        model's own options (``--data.init_args.val_fraction``); None when it names none of them."""
        key = getattr(error, "key", None)
        return next((f"--{group}.init_args.{key}" for group, values in self._groups().items() if key in values), None)

    def read_ckpt_path(self) -> None:
        # Lightning would replace the config's model options by the checkpoint's hyper-parameters. Here what the
        # user gave wins; options that would change the checkpointed model itself are refused instead.
        cfg = self._subcommand_config()
        if not cfg.get("ckpt_path"):
            return
        ckpt = check_checkpoint(cfg.ckpt_path, cfg.model.class_path)
        self._resume_log_step = checkpoint_log_step(ckpt)  # read once here; a resume truncates its log there
        self._checkpoint_run_id = ckpt.get(RUN_ID_KEY)
        conflicts = checkpoint_conflicts(ckpt, cfg)
        if conflicts:
            usage_error(f"ckpt_path: {cfg.ckpt_path} holds another model than the config describes (give the "
                        "run's own config.yaml, or change these options back):\n  " + "\n  ".join(conflicts))
        place_in_checkpoint_run(cfg, self._argv)

    def run_subcommand(self, subcommand: str) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, DDPStrategy):  # read when the process group is made, at the start of fit/test
            set_process_group_timeout(strategy, self.config[subcommand].process_group_timeout)
            give_ranks_time_to_report()
        try:
            self._run_in_run_dir(subcommand)
        except Exception as err:
            if not (strategy.world_size > 1 and is_lost_peer(err)):
                raise
            cfg = self.config[subcommand]
            launcher_lost = launch_rank() != 0 and parent_lost(self._launcher_pid)
            resume = resume_checkpoint(Path(cfg.runs_root) / cfg.run_name)
            message = lost_rank_message(err, strategy, launcher_lost, cfg.process_group_timeout, resume)
            raise LostRankError(message or "") from err

    def _run_in_run_dir(self, subcommand: str) -> None:
        cfg = self.config[subcommand]
        run_dir = Path(cfg.runs_root) / cfg.run_name
        self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if subcommand == "fit":  # on every rank: the ranks agree at each batch's end whether to stop
            saver = SaveOnInterrupt()
            self.trainer.callbacks += [saver, RunIdentity(run_dir)]
            if self._stop_signals is not None:
                self._stop_signals.saver = saver
        if launch_rank() != 0:  # DDP workers, on this node or another: global rank zero holds the directory
            return super().run_subcommand(subcommand)
        check_writable_run_dir(run_dir)  # before anything is written: one message naming the path
        for part in (self.model, *self.trainer.callbacks):  # refusals that would otherwise come at setup
            if hasattr(part, "check_run"):
                part.check_run(self.trainer, self.datamodule)
            if isinstance(part, ModelCheckpoint) and part.dirpath is not None:
                check_checkpoint_dirpath(part.dirpath, run_dir)
        with RunLock(run_dir):
            if subcommand == "fit" and cfg.get("ckpt_path") and checkpoint_run_dir(cfg.ckpt_path) is None:
                self._place_outside_checkpoint(run_dir, cfg)
                self._continue_run(run_dir, cfg)
            elif subcommand == "fit" and cfg.get("ckpt_path"):
                self._continue_run(run_dir, cfg)
            elif subcommand == "fit":
                self.datamodule.prepare_data()  # missing data fails here, before anything on disk is touched
                self._start_fresh(run_dir, cfg)
            fresh = subcommand == "fit" and not cfg.get("ckpt_path") and not run_dir.exists()
            if subcommand == "fit":
                run_id(run_dir, create=True)  # a run older than run identities gets one now
            try:
                super().run_subcommand(subcommand)
            except BaseException as err:
                if fresh and not self._wrote_checkpoint(run_dir):
                    self._clear_failed_launch(run_dir, err)
                if _is_trainer_option_error(err):  # one that needs the data: val_check_interval > batches an epoch
                    usage_error(f"trainer: {str(err).strip()}")
                raise

    def _wrote_checkpoint(self, run_dir: Path) -> bool:
        """Whether this fit saved a checkpoint: in its run directory, or where a checkpoint callback's own dirpath
        put it."""
        return resume_checkpoint(run_dir) is not None or any(
            getattr(c, "last_model_path", "") or getattr(c, "best_model_path", "") for c in self.trainer.callbacks
            if isinstance(c, ModelCheckpoint))

    @staticmethod
    def _clear_failed_launch(run_dir: Path, err: BaseException) -> None:
        """A fresh run that stopped before its first checkpoint holds nothing to resume: the directory it created
        is moved aside (named, nothing deleted), so that launching it again is not refused as a run in the way. A
        usage error stays one line: the move is said at its end."""
        if not run_dir.exists():
            return
        moved = move_aside(run_dir, "failed-")
        if isinstance(err, USAGE_ERRORS) and len(err.args) == 1:
            err.args = (f"{err.args[0]} (the run directory it had made, with no checkpoint, is now {moved})",)
            return
        sys.stderr.write(f"{run_dir} held no checkpoint (the launch stopped before its first): moved to {moved}, "
                         "so the run can be launched again as it was\n")

    @staticmethod
    def _start_fresh(run_dir: Path, cfg: Namespace) -> None:
        moved = prepare_fresh_run(run_dir, cfg.overwrite_run)
        if moved is not None:
            rank_zero_info(f"the previous run in {run_dir} was moved to {moved}")

    def _place_outside_checkpoint(self, run_dir: Path, cfg: Namespace) -> None:
        """A checkpoint kept outside any run directory continues the configured run when it is that run's (the
        identities agree, :class:`~deqscore.lightning.runs.RunIdentity`), and otherwise starts a run of its own
        there: never in a directory that holds another run, unless ``--overwrite_run`` moves that run aside."""
        if not holds_a_run(run_dir):
            return
        if self._checkpoint_run_id is not None and self._checkpoint_run_id == run_id(run_dir):
            return  # a checkpoint of this very run, copied elsewhere: the run continues from it
        if not cfg.overwrite_run:
            usage_error(f"ckpt_path: {cfg.ckpt_path} lies outside any run directory and is not a checkpoint of the "
                        f"run in {run_dir}, so it starts a run of its own, but {run_dir} already holds a run; choose "
                        "another --run_name, or pass --overwrite_run true to move that run aside (to resume that "
                        f"run: --ckpt_path {run_dir}/checkpoints/last.ckpt)")
        self._start_fresh(run_dir, cfg)

    def _continue_run(self, run_dir: Path, cfg: Namespace) -> None:
        """A resume: drop the log rows written after the checkpoint (they are logged again) and apply the
        optimiser options of the config over the restored ones."""
        dropped = truncate_log_after(run_dir / "metrics.csv", self._resume_log_step)
        if dropped:
            rank_zero_info(f"{dropped} rows logged after the checkpoint were dropped from {run_dir / 'metrics.csv'}")
        if cfg.get("optimizer") and type(self.model).configure_optimizers is ScoreModule.configure_optimizers:
            self.trainer.callbacks.append(ConfiguredOptimizerOptions(dict(cfg.optimizer.get("init_args") or {})))

    def add_configure_optimizers(self, subcommand: str | None) -> None:
        # ScoreModule.configure_optimizers only reports a missing `optimizer:`; replacing it is the normal case
        own = type(self.model).configure_optimizers is not ScoreModule.configure_optimizers
        with warnings.catch_warnings():
            if not own:
                warnings.filterwarnings("ignore", message=".*configure_optimizers` will be overridden")
            super().add_configure_optimizers(subcommand)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_name", type=str, default="run", help="name of the run directory")
        parser.add_argument("--runs_root", type=str, default="checkpoints", help="folder holding run directories")
        parser.add_argument("--process_group_timeout", type=float, default=PROCESS_GROUP_TIMEOUT_S,
                            help="seconds a process waits for the others in a collective (DDP) before the run stops")
        parser.add_argument("--overwrite_run", type=bool, default=False,
                            help="a fresh fit into a run directory that holds a run moves the old run aside")
        # the network's input dimension is the data's: one --data option switches data set and network together
        parser.link_arguments("data", "model.init_args.net.init_args.dim", compute_fn=_data_dim, apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        cfg = self._subcommand_config()
        if cfg.trainer.logger is not False:  # false: no logger at all, as asked
            cfg.trainer.logger = _add_loggers(cfg.trainer.logger, cfg.runs_root, cfg.run_name)
        cfg.trainer.default_root_dir = str(Path(cfg.runs_root) / cfg.run_name)
        if cfg.trainer.inference_mode:
            usage_error("trainer.inference_mode must be false: score matching needs input gradients")
        try:
            check_trainer_options(cfg.trainer.as_dict())
        except ConfigError as err:
            usage_error(str(err))
        lr = ((cfg.get("optimizer") or {}).get("init_args") or {}).get("lr")
        if lr is not None and not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
            usage_error(f"optimizer.init_args.lr must be a positive finite number, got {lr!r}")


def _is_trainer_option_error(err: BaseException) -> bool:
    """``err`` is Lightning's refusal of a trainer option: its configuration error, or a ValueError or TypeError
    naming a ``Trainer`` argument as Lightning's messages do (`` `val_check_interval` (1000) must be ...``)."""
    if isinstance(err, MisconfigurationException):
        return True
    names = inspect.signature(Trainer.__init__).parameters
    return type(err) in (ValueError, TypeError) and any(f"`{n}`" in str(err) or f"`Trainer({n}=" in str(err)
                                                        for n in names)


def _data_dim(datamodule: Any) -> int:
    dim = getattr(datamodule, "dim", None)
    if not isinstance(dim, int):
        raise ConfigError(f"{type(datamodule).__name__} has no integer `dim`: a deqscore data module states the "
                          "dimension of one sample (the network's input)")
    return dim


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes/contexts, outermost first."""
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def main(args: list[str] | None = None, stop_signals: StopSignals | None = None) -> DeqscoreCLI:
    """Entry point of ``train.py``."""
    family_registry()  # every family imported: a short class name (--model NICEModule) finds its class
    return DeqscoreCLI(args=args, stop_signals=stop_signals)


def run(args: list[str] | None = None) -> int:
    """``train.py``: :func:`main`, with usage mistakes reported as one message and exit status 2. A run whose ranks
    stopped together (finished, preempted, or stopped at a non-finite loss) leaves its process group on every rank
    before exiting, so that none can abort in the interpreter's exit (:func:`leave_process_group`). A stop or a
    failure of every rank is told once, by the first process; SIGTERM, SIGUSR1 and Ctrl-C are held for the whole
    command (:class:`~deqscore.cli.signals.StopSignals`): after a finished fit the status stays 0."""
    with StopSignals() as stops:
        try:
            main(args, stops)
            leave_process_group()
        except UsageError as err:
            return err.code
        except Preempted as err:
            if launch_rank() == 0:
                print_error(_stop_text(err))
            leave_process_group()
            return err.code
        except USAGE_ERRORS as err:  # found after parsing: no optimizer, no data
            print_error(str(err))
            return 2
        except LostRankError as err:  # said by the process that can tell (the first of its node); the others quiet
            if str(err):
                print_error(str(err))
            return 1
        except NonFiniteLossError as err:  # every rank stopped at the same step; the line once, from the first
            if launch_rank() == 0:
                print_error(str(err))
            leave_process_group()
            return 1
        if stops.after_training is not None and launch_rank() == 0:
            sys.stderr.write(f"{signal.Signals(stops.after_training).name} came after training finished: the run is "
                             "complete (exit status 0), nothing to resume\n")
    return 0


def _stop_text(err: Preempted) -> str:
    how = "interrupted by Ctrl-C" if err.signum == signal.SIGINT else f"preempted by {signal.Signals(err.signum).name}"
    if not err.saved:
        return f"{how} before training started: nothing to save; launch it again as it was"
    if err.at_once:
        return (f"{how} twice: the state where it landed is in checkpoints/interrupted.ckpt (a resume from it is one "
                "step off); resume with --ckpt_path <run>/checkpoints/interrupted.ckpt")
    return (f"{how}: the run's state is in its checkpoints/interrupted.ckpt; resume with --ckpt_path "
            "<run>/checkpoints/interrupted.ckpt")


def console() -> None:
    """The ``deqscore-train`` command (what ``python train.py`` does, for an installed package)."""
    code = run()
    # The interpreter's exit collects every object once more while it takes its modules apart (~400,000 here):
    # seconds on a loaded 2-core machine, beyond a scheduler's grace after SIGTERM. Frozen, they are left to the
    # process's end; every file of the run is closed and every logger finished by now.
    gc.freeze()
    sys.exit(code)
