"""Configs show what differs: no config, composed with its bases, restates any default that the code already sets
(``--print_config`` shows the whole, defaults included); there is no list of exempt keys."""

import importlib
import inspect

import pytest

from deqscore.configfiles import load_config

from .conftest import CONFIGS

CLI_DEFAULTS = {"runs_root": "checkpoints"}
TRAINER_DEFAULTS = {"inference_mode": False}  # the CLI's


def _defaults(class_path: str) -> dict:
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _same(value, default) -> bool:
    """A YAML value equal to a code default of the same kind: a YAML list and a tuple default compare as sequences,
    ``0.0`` and ``0`` as numbers; ``0`` and ``False`` do not count as the same."""
    if isinstance(value, list) and isinstance(default, list | tuple):
        return len(value) == len(default) and all(_same(v, d) for v, d in zip(value, default, strict=True))
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (value, default))
    return not isinstance(value, dict | list) and (numbers or type(value) is type(default)) and value == default


def _restated(node, where: str) -> list[str]:
    found = []
    if isinstance(node, dict) and "class_path" in node and isinstance(node.get("init_args"), dict):
        defaults = _defaults(node["class_path"])
        for key, value in node["init_args"].items():
            if key in defaults and _same(value, defaults[key]):
                found.append(f"{where}.{key}: {value!r}")
            found += _restated(value, f"{where}.{key}")
    elif isinstance(node, dict):
        for key, value in node.items():
            found += _restated(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _restated(value, f"{where}[{i}]")
    return found


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_configs_do_not_restate_code_defaults(config):
    cfg = load_config(config)
    found = [f"{k}: {v!r}" for k, v in CLI_DEFAULTS.items() if cfg.get(k) == v]
    found += [f"trainer.{k}: {v!r}" for k, v in TRAINER_DEFAULTS.items() if (cfg.get("trainer") or {}).get(k) == v]
    found += _restated({k: cfg[k] for k in ("model", "data", "trainer", "optimizer") if k in cfg}, "")
    assert not found, f"{config.name} restates defaults: {found}"
