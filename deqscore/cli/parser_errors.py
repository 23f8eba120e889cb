"""The command-line parser's mistakes as one message: the key, what is wrong, and the accepted values."""

from __future__ import annotations

import re
from typing import NoReturn

from pytorch_lightning.cli import LightningArgumentParser

from .errors import usage_error

OPTIMIZER_HINT = "any torch.optim optimizer by class name or class_path, e.g. Adam, AdamW, SGD, RMSprop"
LR_SCHEDULER_HINT = "any torch.optim.lr_scheduler class by name or class_path, e.g. StepLR, CosineAnnealingLR"


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
        if message.split(":")[0] == "optimizer":
            message += f"\n  accepted: {OPTIMIZER_HINT}"
        if message.split(":")[0] == "lr_scheduler":
            message += f"\n  accepted: {LR_SCHEDULER_HINT}"
        usage_error(message + "\n(see --help for every option)")
