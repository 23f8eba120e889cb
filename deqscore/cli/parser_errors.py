"""A command line the parser refuses, told as one message: the option at fault and the values it accepts.

jsonargparse reports a refused value as text only (a tree of every type it tried). The option at fault is found
instead by parsing the command line again without one option at a time (the last first): the one whose absence
lets it parse. What it accepts is read from the signature of the class the option belongs to, in the command line
that parsed.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from argparse import ArgumentError
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import Namespace
from pytorch_lightning import Trainer

OPTIMIZER_HINT = "any torch.optim optimizer by class name or class_path, e.g. Adam, AdamW, SGD, RMSprop"
LR_SCHEDULER_HINT = "any torch.optim.lr_scheduler class by name or class_path, e.g. StepLR, CosineAnnealingLR"
CONFIG_FLAGS = ("--config", "-c")
HINTS = {"optimizer": OPTIMIZER_HINT, "lr_scheduler": LR_SCHEDULER_HINT}
SCALARS = {int: "an int", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def explain_refusal(parser: Any, args: list[str], message: str) -> str:
    """What is wrong with ``args``, which ``parser`` refused with jsonargparse's ``message``: ``key: what`` and,
    where known, the accepted values; jsonargparse's first line where no single option is at fault."""
    head, items = _split(args)
    fault = _fault(parser, head, items)
    if fault is None or fault[0][0] in CONFIG_FLAGS:  # which value of a (composed) config file
        configs = [i for i, item in enumerate(items) if item[0] in CONFIG_FLAGS]
        fault = next(filter(None, (_config_fault(parser, head, items, i) for i in reversed(configs))), None)
    if fault is None:
        return message.strip().splitlines()[0]
    (flag, *values), cfg = fault
    return describe(flag.lstrip("-"), " ".join(values), cfg)


def _split(args: list[str]) -> tuple[list[str], list[list[str]]]:
    """The subcommand (the tokens before the first option) and the options, each with its values."""
    head: list[str] = []
    items: list[list[str]] = []
    for token in args:
        if token.startswith("--") or token == "-c":
            items.append(token.split("=", 1) if token.startswith("--") and "=" in token else [token])
        elif items:
            items[-1].append(token)
        else:
            head.append(token)
    return head, items


def _parses(parser: Any, head: list[str], items: list[list[str]]) -> Namespace | None:
    try:
        cfg = parser.parse_args([*head, *(token for item in items for token in item)])
    except (ArgumentError, TypeError, ValueError, KeyError):
        return None
    return cfg.get(str(cfg.get("subcommand")), cfg)


def _fault(parser: Any, head: list[str], items: list[list[str]]) -> tuple[list[str], Namespace] | None:
    """The option whose absence lets the command line parse, with the config parsed without it."""
    for index in reversed(range(len(items))):
        cfg = _parses(parser, head, items[:index] + items[index + 1:])
        if cfg is not None:
            return items[index], cfg
    return None


def _leaves(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict) or not tree:
        return [prefix]
    return [leaf for key, value in tree.items() for leaf in _leaves(value, f"{prefix}{'.' if prefix else ''}{key}")]


def _without(tree: dict, path: str) -> dict:
    head, _, rest = path.partition(".")
    out = dict(tree)
    if rest:
        out[head] = _without(tree[head], rest)
    else:
        del out[head]
    return out


def _config_fault(parser: Any, head: list[str], items: list[list[str]], index: int):
    """The value of a ``--config`` (a file, or the text a composed one became) whose absence lets the command line
    parse, as ``[--key, value]``."""
    flag, text = items[index][0], " ".join(items[index][1:])
    try:
        tree = yaml.safe_load(Path(text).read_text() if "\n" not in text and Path(text).is_file() else text)
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(tree, dict):
        return None
    for leaf in reversed(_leaves(tree)):
        trial = [*items[:index], [flag, yaml.safe_dump(_without(tree, leaf))], *items[index + 1:]]
        cfg = _parses(parser, head, trial)
        if cfg is not None:
            value = tree
            for part in leaf.split("."):
                value = value[part]
            return [f"--{leaf}", yaml.safe_dump(value).strip().removesuffix("...").strip()], cfg
    return None


def describe(key: str, value: str, cfg: Namespace | None) -> str:
    """``key: 'value' is not accepted`` and what is, from the signature of the class ``key`` belongs to in ``cfg``
    (the config parsed without it)."""
    if key in HINTS or key.removesuffix(".class_path") in HINTS:
        return f"{key}: {value!r} is not accepted\n  accepted: {HINTS[key.removesuffix('.class_path')]}"
    cfg = Namespace() if cfg is None else cfg
    parts = key.split(".")
    owner, start = (Trainer, 1) if parts[0] == "trainer" else (None, 0)
    for i in range(1, len(parts)):
        held = cfg.get(".".join(parts[:i]))
        if isinstance(held, Namespace) and isinstance(held.get("class_path"), str):
            owner, start = _import(held.class_path), i
        elif isinstance(held, str) and i < len(parts):  # a short name (``loss: ssm``) given options of its own
            parent, option = ".".join(parts[:i]), ".".join(parts[i:]).removeprefix("init_args.")
            return (f"{parent}: cannot set {option}={value!r} on a short name; give {parent} as a class_path first "
                    f"(e.g. --{parent} SomeClass --{parent}.{option} VALUE)")
    rest = [p for p in parts[start:] if p != "init_args"]
    if owner is None or not rest:
        return f"{key}: {value!r} is not accepted"
    options = inspect.signature(owner).parameters
    if rest[0] not in options:
        names = [n for n, p in options.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        close = difflib.get_close_matches(rest[0], names, n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else f"its options: {', '.join(names)}"
        return f"{key}: {owner.__name__} has no option {rest[0]!r}\n  {hint}"
    return f"{key}: {value!r} is not accepted\n  accepted: {accepted(_hints(owner).get(rest[0], 'any'))}"


def accepted(hint: Any) -> str:
    """A type hint in words: literals by value, classes as a class_path of a subclass, plain types by kind."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = typing.get_args(hint)
    else:
        parts = (hint,)
    literals = [repr(v) for p in parts if typing.get_origin(p) is Literal for v in typing.get_args(p)]
    classes = [p.__name__ for p in parts if inspect.isclass(p) and p not in SCALARS]
    words = [f"a class_path of a {' / '.join(classes)} subclass"] if classes else []
    words += [SCALARS[p] for p in parts if p in SCALARS]
    words += [str(p) for p in parts if typing.get_origin(p) is not Literal and not inspect.isclass(p)]
    return ", ".join([", ".join(literals), *(f"or {w}" for w in words)]) if literals else " or ".join(words)


def _hints(owner: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(owner.__init__)
    except Exception:  # noqa: BLE001 - a hint that cannot be resolved here: its text
        return {n: p.annotation for n, p in inspect.signature(owner).parameters.items()}


def _import(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)
