"""The family sections' networks: built from the training configs (``configs/<family>/*.yaml``) by the training
code's own builder (:func:`deqscore.lightning.build_module`), with each benchmark's options applied on top.

Options are dotted model keys whose ``init_args`` levels are implied: ``net.deq.tol`` is
``model.init_args.net.init_args.deq.init_args.tol`` of the config.

>>> config = model_config("configs/nice/deq.yaml", {"net.hidden": 8, "net.deq.tol": 1e-3})
>>> net = config["init_args"]["net"]["init_args"]
>>> net["hidden"], net["deq"]["init_args"]["tol"]
(8, 0.001)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from pytorch_lightning.cli import instantiate_class

from deqscore.configfiles import load_config
from deqscore.families import ROOT
from deqscore.lightning import build_module
from deqscore.lightning.base import ScoreModule

Options = Mapping[str, object]
NO_OPTIONS: Options = MappingProxyType({})


@dataclass(frozen=True)
class Variant:
    """One row kind of a family section: a label, its config and the options that make it this variant."""

    label: str
    config: str  # relative to the repository root
    options: Options = field(default_factory=dict)


def read_config(config: str | Path) -> dict[str, Any]:
    """The whole run config in ``config`` (relative to the repository root unless absolute)."""
    return load_config(ROOT / config)


def set_option(tree: dict[str, Any], key: str, value: object) -> None:
    """Set dotted ``key`` in a ``class_path``/``init_args`` tree; a missing level raises ``KeyError``."""
    *parents, last = key.split(".")
    node = tree
    for part in parents:
        node = _args(node)[part]
    _args(node)[last] = value


def _args(node: dict[str, Any]) -> dict[str, Any]:
    if "class_path" in node:
        return node.setdefault("init_args", {})
    return node


def model_config(config: str | Path, options: Options = NO_OPTIONS) -> dict[str, Any]:
    """The ``model:`` entry of ``config`` with ``options`` applied."""
    tree = copy.deepcopy(read_config(config)["model"])
    for key, value in options.items():
        set_option(tree, key, value)
    return tree


def build(config: str | Path, options: Options = NO_OPTIONS) -> ScoreModule:
    """The module of ``config`` with ``options``, initialised from the config's ``seed_everything``."""
    torch.manual_seed(read_config(config).get("seed_everything", 0))
    return build_module(model_config(config, options))


def attach_optimizer(module: ScoreModule, config: str | Path) -> None:
    """Give ``module`` the optimiser of ``config``'s ``optimizer:`` entry, as LightningCLI does for training."""
    spec = read_config(config)["optimizer"]
    module.configure_optimizers = lambda: instantiate_class(module.parameters(), spec)  # type: ignore[method-assign]


def options_text(options: Options) -> str:
    """``key=value, ...`` for the notes (``-`` for none)."""
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "-"
