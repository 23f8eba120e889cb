"""Configs state only what differs: no config file, base or runnable, states an option that its bases or the code
already give it (``--print_config`` shows the whole, defaults included). There is no list of exempt keys. A value
that undoes a base's (``monitor: null`` where the base monitors a loss) changes something and is stated.

Nor do their comments restate a code default that no file holds (it would drift from the code unseen): a number in
a comment that equals such a default, and no value the composed config holds, is refused (counts below 10 are too
common to tell apart and are left out)."""

import importlib
import inspect
import re

import pytest
from pytorch_lightning import Trainer

from deqscore.configfiles import base_options, composed, load_config, read_mapping

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


# ----- comments ----------------------------------------------------------------------------------------------
#: a number of a comment: 0.999, 5,000, 6.2e-6 (not the 10 of CIFAR-10, the 2 of stride-2 or a section number)
COMMENT_NUMBER = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?(?:e-?\d+)?(?![\w-])")
SECTION = re.compile(r"(?:method\.md|sections?)\s+[\d.]+(?:(?:,|\s+and)\s+[\d.]+)*")
SMALL_COUNT = 10


def _numeric(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _class_at(class_path: str):
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _code_defaults(cls, prefix: str) -> dict[str, object]:
    """``{"Class.option": default}`` of ``cls``, a default object's own defaults under its option's name (the
    samplers' ``lazy_instance`` defaults)."""
    out = {}
    for key, default in _defaults(cls).items():
        lazy = getattr(default, "lazy_get_init_data", None)
        if lazy is not None:
            out |= _code_defaults(_class_at(lazy().as_dict()["class_path"]), f"{prefix}.{key}")
        else:
            out[f"{prefix}.{key}"] = default
    return out


def unheld_defaults(config: dict) -> dict[str, object]:
    """The numeric code defaults a composed config leaves in place: the options of every class it names that it
    does not set, and the trainer's."""
    found = {f"Trainer.{k}": v for k, v in TRAINER_DEFAULTS.items() if k not in (config.get("trainer") or {})}

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("class_path"), str):
                given = node.get("init_args") or {}
                cls = _class_at(node["class_path"])
                found.update({k: v for k, v in _code_defaults(cls, cls.__name__).items()
                              if k.split(".")[1] not in given})
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    return {k: v for k, v in found.items() if _numeric(v)}


def comment_numbers(config_file) -> list[tuple[str, float]]:
    numbers = []
    for line in config_file.read_text().splitlines():
        text = SECTION.sub("", line.split("#", 1)[1]) if "#" in line else ""
        numbers += [(m.group(), float(m.group().replace(",", ""))) for m in COMMENT_NUMBER.finditer(text)]
    return numbers


def restated_in_comments(config_file) -> list[str]:
    """The numbers of ``config_file``'s comments that restate a code default no file of it holds."""
    config = load_config(config_file)
    defaults = unheld_defaults(config)
    held = set()

    def hold(node):
        if isinstance(node, dict | list):
            for value in node.values() if isinstance(node, dict) else node:
                hold(value)
        elif _numeric(node):
            held.add(float(node))

    hold(config)
    found = []
    for text, number in comment_numbers(config_file):
        if number in held or (number == int(number) and number < SMALL_COUNT):
            continue
        names = [name for name, default in defaults.items() if float(default) == number]
        if names:
            found.append(f"{text} ({' or '.join(names)})")
    return found


@pytest.mark.parametrize("config_file", CONFIG_FILES, ids=lambda c: str(c.relative_to(ROOT / "configs")))
def test_no_comment_restates_a_code_default_that_no_file_holds(config_file):
    assert not restated_in_comments(config_file), f"{config_file.name}'s comments restate code defaults: " \
        f"{restated_in_comments(config_file)}; drop the number, or --print_config shows it"


def test_a_restated_default_in_a_comment_is_found(tmp_path):
    """The check can fail: a default of the module, of a default sampler and of a callback, in a comment; a value a
    file holds, a small count and a section number are not flagged."""
    (tmp_path / "run.yaml").write_text(
        "# sigma 50 -> 0.01 over 232 levels, step_lr 6.2e-6, EMA 0.999; patience 7, 4 steps (method.md 4.4)\n"
        "model:\n  class_path: deqscore.lightning.NCSNModule\n  init_args:\n    sigma_max: 50.0\n"
        "trainer:\n  callbacks:\n  - class_path: pytorch_lightning.callbacks.EMAWeightAveraging\n"
        "  - {class_path: pytorch_lightning.callbacks.EarlyStopping, init_args: {monitor: x, patience: 7}}\n")
    assert restated_in_comments(tmp_path / "run.yaml") == [
        "0.01 (NCSNModule.sigma_min)", "232 (NCSNModule.n_levels)", "6.2e-6 (NCSNModule.sampler.step_lr)",
        "0.999 (EMAWeightAveraging.decay)"]
