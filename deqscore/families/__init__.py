"""One declaration per model family: the family registry every other place reads.

A family is its model file, its module file (a :class:`~deqscore.lightning.ScoreModule` subclass), its config
folder and its declaration here: a module ``deqscore/families/<name>.py`` holding ``DECLARATION``, a
:class:`Declaration`. The training registry (:func:`deqscore.lightning.family_registry`) is the declarations'
class paths; a family without a declaration is unknown to the CLI, to ``load_module`` and to every test.

The declarations are data (class paths and config names as text), so the package sits on a low floor and reads
nothing of the floors above: the Lightning layer reads it to find the family classes. The tests' fixtures of a
family (``tests/families/<name>.py``) and the laboratory's entries (``lab/``) are keyed by the family's name.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

from ..configfiles import is_base

ROOT = Path(__file__).resolve().parents[2]  # the repository (configs/ lives here)

#: what a config does in a comparison: the explicit network of the DEQ's size, a deeper explicit one, the DEQ, and
#: the reference implementation's design of the DEQ
ROLES = ("shallow", "deep", "deq", "reference")


def net_options(config: dict) -> dict:
    """The network's options in a composed config (``model.init_args.net.init_args``; empty where all are defaults)."""
    return ((config["model"].get("init_args") or {}).get("net") or {}).get("init_args") or {}


@dataclass(frozen=True)
class Declaration:
    name: str
    module: str  # class path of its ScoreModule
    configs: dict[str, str]  # role -> config file in configs/<name>/
    extra_configs: tuple[str, ...] = ()  # configs of the family outside its folder (the demo)

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


def declarations() -> dict[str, Declaration]:
    """Every family's declaration, by name, in the order of the files' names (read afresh at each call)."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        declaration = getattr(module, "DECLARATION", None)
        if isinstance(declaration, Declaration):
            found[declaration.name] = declaration
    return found
