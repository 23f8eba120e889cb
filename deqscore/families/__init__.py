"""One declaration per model family, and the registry every other place reads.

A family is its model file, its module file (a :class:`~deqscore.lightning.ScoreModule` subclass, which registers
itself for training), its config folder and its declaration here: a module ``deqscore/families/<name>.py`` holding
``DECLARATION``, a :class:`Declaration`.

What reads the declarations: the training registry, the tests' fixtures (every config of the folder, shrunk by
``tiny``) and the laboratory (``lab/``: the benchmarks and the study; the library never imports it). A test checks
that the declarations, the training registry and the config folders name the same families.

The declarations are data (class paths and config names as text); the package sits on the floor above the Lightning
layer, whose constants it may name, and below the command-line programs that read it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..configfiles import is_base

ROOT = Path(__file__).resolve().parents[2]  # the repository (configs/ lives here)

#: what a config does in a comparison: the explicit network of the DEQ's size, a deeper explicit one, the DEQ, and
#: the reference implementation's design of the DEQ
ROLES = ("shallow", "deep", "deq", "reference")

# (config as loaded from YAML, a folder of fake on-disk images for data sets not stored offline) -> overrides
Tiny = Callable[[dict, Callable[[], Path]], list[str]]
# a DEQ factory -> (a tiny float64 model of the family built with it, its loss as a closure)
Probe = Callable[[Callable], tuple[Any, Callable[[], Any]]]

# option pieces the declarations share
NET = "--model.init_args.net.init_args"
MNIST_WORKERS = ["--data.init_args.num_workers", "0"]
MNIST_SUBSETS = ["--data.init_args.train_subset", "48", "--data.init_args.val_subset", "16",
                 "--data.init_args.test_subset", "16"]
TINY_MNIST = ["--data.init_args.train_subset", "32", "--data.init_args.val_subset", "16",
              "--data.init_args.test_subset", "16", "--data.init_args.batch_size", "8",
              "--data.init_args.eval_batch_size", "8", *MNIST_WORKERS]
#: the study test's MNIST subsets, as KEY=VALUE (the study passes them on in one list)
STUDY_MNIST = ("--data.init_args.train_subset=48", "--data.init_args.val_subset=16",
               "--data.init_args.test_subset=16", "--data.init_args.eval_batch_size=16")


def net_options(config: dict) -> dict:
    """The network's options in a composed config (``model.init_args.net.init_args``; empty where all are defaults)."""
    return ((config["model"].get("init_args") or {}).get("net") or {}).get("init_args") or {}


@dataclass(frozen=True)
class Depth:
    """An entry of the depth section: activation memory against depth for one DEQ config of the family.

    ``inputs`` and ``loss`` name how a measured step is fed and what it differentiates (the section's
    ``INPUTS`` and ``LOSSES``); ``train_args``: the short training run measuring the effective depth, per mode
    (None: no real data offline, no effective depth)."""

    label: str
    config: str  # relative to the repository
    sizes: dict[str, dict]
    batch: dict[str, int]
    inputs: str
    loss: str = "module"
    train_args: dict[str, list[str]] | None = None
    deq_options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StudyVariant:
    """One network of the study: the config of a role (or another config file), with overrides."""

    role: str  # a key of Declaration.configs, or "classical" / "untrained" with ``config``
    label: str  # "shallow", "deep", "deq", "deq_faithful", "deq_reference", "classical" or "untrained"
    overrides: tuple[str, ...] = ()
    steps_per_iteration: int = 1  # optimiser steps per training iteration (the implicit VAE: 2 score + 1)
    trained: bool = True  # False: the network at initialisation, through the same evaluation
    config: str | None = None  # a config file of the folder outside the roles (the Gaussian VAE)


@dataclass(frozen=True)
class Metric:
    key: str  # in a unit's metrics
    label: str
    higher_is_better: bool


@dataclass(frozen=True)
class Study:
    """What the family brings to the reproduction study (the protocol fixes budget, seeds and evaluation sizes).
    ``iterations``: the training length at budget 1; ``metrics[0]``: the quality the claim is judged on;
    ``groups``: the data sets with their fit overrides; ``tiny``: (study options, fit options) of the tests."""

    title: str
    setting: str
    iterations: int
    variants: dict[str, StudyVariant]
    metrics: tuple[Metric, ...]
    groups: dict[str, tuple[str, ...]] = field(default_factory=lambda: {"mnist": ()})
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    context: str = ""
    tiny: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())


@dataclass(frozen=True)
class Declaration:
    name: str
    module: str  # class path of its ScoreModule
    configs: dict[str, str]  # role -> config file in configs/<name>/
    tiny: Tiny  # overrides that shrink any of its configs to seconds on a CPU
    depth: dict[str, Depth] = field(default_factory=dict)
    study: Study | None = None
    extra_configs: tuple[str, ...] = ()  # configs of the family outside its folder (the demo)
    #: the family's DEQ under its own loss, tiny: tests/deq/test_family_phantom.py checks its phantom gradients
    #: against the damped steps written out by hand (required of a family with a DEQ config)
    phantom_probe: Probe | None = None

    @property
    def config_dir(self) -> Path:
        return ROOT / "configs" / self.name

    def config(self, role: str) -> str:
        """The config of ``role``, relative to the repository."""
        return f"configs/{self.name}/{self.configs[role]}"

    def all_configs(self) -> list[Path]:
        """Every config of the family: its folder's and its extra ones."""
        return [*sorted(p for p in self.config_dir.glob("*.yaml") if not is_base(p)),
                *(ROOT / c for c in self.extra_configs)]

    def variant_config(self, variant: StudyVariant) -> str:
        return f"configs/{self.name}/{variant.config}" if variant.config else self.config(variant.role)


def declarations() -> dict[str, Declaration]:
    """Every family's declaration, by name, in the order of the files' names."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        declaration = getattr(module, "DECLARATION", None)
        if isinstance(declaration, Declaration):
            found[declaration.name] = declaration
    return found

