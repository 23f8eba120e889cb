"""A checkpoint given to ``train.py``: refused unless it is of the configured family and architecture, and placed
in the run directory that holds it (a resume never writes into another run)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from pytorch_lightning.utilities import rank_zero_info

from ..deq import DEQ
from ..lightning import family_registry
from ..lightning.base import CODEC_KEY, FAMILY_KEY, CheckpointFamilyError
from ..lightning.checkpoint import read_checkpoint
from ..lightning.runs import checkpoint_run_dir
from ..privates import CLASS_PATH_KEY
from .errors import usage_error


def typed_option(argv: list[str], option: str) -> str | None:
    """The last value given to ``--option`` on the command line itself (not in a config file), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{option}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif isinstance(arg, str) and arg.startswith(f"--{option}="):
            value = arg.split("=", 1)[1]
    return value


def place_in_checkpoint_run(cfg: Namespace, argv: list[str]) -> None:
    """A command given a checkpoint of a run directory (``<run>/checkpoints/*.ckpt``) works in that directory, where
    it lies now, whatever run name and runs root its ``config.yaml`` records (the run may have been moved or copied
    since, and another run may live under the recorded name). A ``--run_name`` or ``--runs_root`` typed on the
    command line that names another directory is refused, naming both: a resume never writes into another run."""
    run_dir = checkpoint_run_dir(cfg.ckpt_path)
    if run_dir is None:  # a checkpoint kept outside any run: it starts or continues the configured run
        return
    configured = Path(cfg.runs_root) / cfg.run_name
    name, root = typed_option(argv, "run_name"), typed_option(argv, "runs_root")
    if (name is not None and name != run_dir.name) or (
            root is not None and Path(root).resolve() != run_dir.parent.resolve()):
        typed = Path(root if root is not None else cfg.runs_root) / (name if name is not None else cfg.run_name)
        usage_error(f"ckpt_path: {cfg.ckpt_path} belongs to the run in {run_dir}, but --run_name/--runs_root name "
                    f"the run directory {typed}; a checkpoint of a run resumes only in the directory that holds "
                    f"it: leave out --run_name and --runs_root, or give --runs_root {run_dir.parent} --run_name "
                    f"{run_dir.name}")
    if configured.resolve() == run_dir.resolve():
        return
    rank_zero_info(f"working in {run_dir}, the run directory that holds {cfg.ckpt_path} (its config names "
                   f"{configured})")
    cfg.runs_root, cfg.run_name = str(run_dir.parent), run_dir.name


def check_checkpoint(path: str, class_path: str) -> dict[str, Any]:
    """A usage error unless ``path`` is a readable deqscore checkpoint of the configured model's family."""
    try:
        ckpt = read_checkpoint(path)
    except (FileNotFoundError, CheckpointFamilyError) as err:
        usage_error(f"ckpt_path: {err}")
    family = next((f for f, cls in family_registry().items()  # by the class's name: packages re-export it
                   if class_path.rpartition(".")[2] == cls.__qualname__), None)
    if family and ckpt[FAMILY_KEY] != family:
        usage_error(f"ckpt_path: {path} holds a {ckpt[FAMILY_KEY]!r} model, but the config describes a {family!r} "
                    f"model ({class_path}); give a checkpoint of the config's family, or that checkpoint's own "
                    "config.yaml")
    return ckpt


def is_deq_config(value: Any) -> bool:
    """Whether ``value`` configures a DEQ layer: a class_path that resolves to :class:`deqscore.deq.DEQ` or a
    subclass of it (a user's own layer included), whatever its name."""
    if not isinstance(value, dict) or not isinstance(value.get("class_path"), str):
        return False
    module, _, name = value["class_path"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, DEQ)


def differences(saved: Any, given: Any, key: str) -> list[str]:
    """``key: checkpoint A, config B`` for every differing leaf; the options of DEQ layers are skipped (they say
    how the fixed point is solved, not what it is)."""
    if is_deq_config(saved) and is_deq_config(given):
        return []
    if given is None:  # not set in the config: filled in by a link (the network's dim) or left to its default
        return []
    if isinstance(saved, dict) and isinstance(given, dict):
        return [d for k in sorted(set(saved) | set(given))
                for d in differences(saved.get(k), given.get(k), f"{key}.{k}")]
    if isinstance(saved, list | tuple) and isinstance(given, list | tuple):  # YAML lists vs Python tuples
        saved, given = list(saved), list(given)
    return [] if saved == given else [f"{key}: checkpoint {saved!r}, config {given!r}"]


def checkpoint_conflicts(ckpt: dict[str, Any], cfg: Namespace) -> list[str]:
    """Options of ``cfg`` that would change the model stored in ``ckpt``: the module class, its network (``net``)
    and the data transform the network was trained on. Evaluation and training options are free to differ."""
    saved = ckpt.get("hyper_parameters") or {}
    model = cfg.model.as_dict() if isinstance(cfg.model, Namespace) else dict(cfg.model)
    conflicts = []
    if CLASS_PATH_KEY in saved:
        conflicts += differences(saved[CLASS_PATH_KEY], model.get("class_path"), "model.class_path")
        conflicts += differences(saved.get("net"), model.get("init_args", {}).get("net"), "model.init_args.net")
    codec = ckpt.get(CODEC_KEY)
    data = cfg.get("data")
    data_args = (data.get("init_args") or {}) if isinstance(data, Namespace | dict) else {}
    for option in ("transform", "alpha"):
        if codec and option in data_args:
            conflicts += differences(codec[option], data_args[option], f"data.init_args.{option}")
    return conflicts
