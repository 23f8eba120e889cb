"""Configs state only what differs: no config file, base or runnable, states an option that its bases or the code
already give it (``--print_config`` shows the whole, defaults included). There is no list of exempt keys. A value
that undoes a base's (``monitor: null`` where the base monitors a loss) changes something and is stated."""

import importlib
import inspect

import pytest
from pytorch_lightning import Trainer

from deqscore.configfiles import base_options, composed, read_mapping

from .conftest import ROOT

CONFIG_FILES = sorted((ROOT / "configs").rglob("*.yaml"))
TOP_DEFAULTS = {"runs_root": "checkpoints"}  # the CLI's own options


def _defaults(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _class_defaults(class_path: str) -> dict:
    module, _, name = class_path.rpartition(".")
    return _defaults(getattr(importlib.import_module(module), name))


TRAINER_DEFAULTS = {**_defaults(Trainer), "inference_mode": False}  # the CLI sets inference_mode


def _same(value, default) -> bool:
    """A YAML value equal to a default of the same kind: a YAML list and a tuple default compare as sequences,
    ``0.0`` and ``0`` as numbers; ``0`` and ``False`` do not count as the same."""
    if isinstance(value, list) and isinstance(default, list | tuple):
        return len(value) == len(default) and all(_same(v, d) for v, d in zip(value, default, strict=True))
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (value, default))
    return not isinstance(value, dict | list) and (numbers or type(value) is type(default)) and value == default


_MISSING = object()


def _at(node, path):
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _code_default(whole: dict, path: tuple):
    """The code's default for the option at ``path``: the ``__init__`` default of the class whose ``init_args`` hold
    it, the trainer's or the CLI's (``_MISSING`` where the code has none)."""
    if len(path) == 1:
        return TOP_DEFAULTS.get(path[0], _MISSING)
    if len(path) == 2 and path[0] == "trainer":
        return TRAINER_DEFAULTS.get(path[1], _MISSING)
    owner = _at(whole, path[:-2])
    if path[-2] == "init_args" and isinstance(owner, dict) and isinstance(owner.get("class_path"), str):
        return _class_defaults(owner["class_path"]).get(path[-1], _MISSING)
    return _MISSING


def _leaves(node, path=()):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif path:
        yield path, node


def restated(config_file) -> list[str]:
    """The options ``config_file`` states that change nothing: each equal to what its bases, or else the code,
    already give."""
    stated = read_mapping(config_file)
    stated.pop("base", None)
    below, whole = base_options(config_file), composed(config_file)
    found = []
    for path, value in _leaves(stated):
        before = _at(below, path)
        if before is _MISSING:
            before = _code_default(whole, path)
        if before is not _MISSING and _same(value, before):
            found.append(f"{'.'.join(map(str, path))}: {value!r}")
    return found


@pytest.mark.parametrize("config_file", CONFIG_FILES, ids=lambda c: str(c.relative_to(ROOT / "configs")))
def test_no_config_file_states_what_its_bases_or_the_code_already_give(config_file):
    assert not restated(config_file), f"{config_file.name} restates: {restated(config_file)}"


def test_a_restated_option_is_found(tmp_path):
    """The check can fail: a code default, a base's value, and a list equal to a tuple default are each found."""
    (tmp_path / "_b.yaml").write_text("trainer: {max_epochs: 5}\noptimizer: {class_path: torch.optim.Adam}\n")
    (tmp_path / "run.yaml").write_text(
        "base: _b.yaml\ntrainer: {max_epochs: 5, inference_mode: false, max_steps: 7}\n"
        "optimizer: {init_args: {betas: [0.9, 0.999], lr: 0.5}}\n")
    assert restated(tmp_path / "run.yaml") == ["trainer.max_epochs: 5", "trainer.inference_mode: False",
                                               "optimizer.init_args.betas: [0.9, 0.999]"]
