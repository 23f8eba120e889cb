"""Config files that compose. A config may name a base, ``base: _shared.yaml`` (or a list, applied in order): a
path relative to the config's own folder, or ``deqscore:<path>``, a config shipped in the repository's
``configs/`` folder (``base: deqscore:dkef/deq.yaml`` works from anywhere, so a copy of a shipped config can name its
bases that way). The config's options then override the base's: mappings are merged key by key, anything else (a
value, a list) is replaced whole. Any config may be a base, a runnable one included (``dkef/deq_reference.yaml``
is ``deq.yaml`` plus one option); files whose names start with ``_`` are only bases, never run alone. A relative
base that is not there (a config copied out of ``configs/``) is reported in one line that names the
``deqscore:`` path of the shipped file it meant. Every reader of a config goes through :func:`load_config` (the
command line, the benchmarks, the tests), so a config means the same everywhere.

The trainer's callbacks may be written as a mapping of named callbacks (``trainer.callbacks.checkpoint: {class_path:
..., init_args: ...}``), so that they compose like any other mapping: a config changes one option of a base's
callback by its name, adds a callback under a new name, and drops one by setting its name to null. The composed
config lists them, in the mapping's order, as the trainer takes them.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = (d / "_base.yaml").write_text("trainer: {max_epochs: 10, log_every_n_steps: 5}\\nseed_everything: 1\\n")
>>> _ = (d / "run.yaml").write_text("base: _base.yaml\\ntrainer: {max_epochs: 2}\\n")
>>> load_config(d / "run.yaml")
{'trainer': {'max_epochs': 2, 'log_every_n_steps': 5}, 'seed_everything': 1}
>>> _ = (d / "_cb.yaml").write_text("trainer: {callbacks: {a: {class_path: A}, b: {class_path: B}}}\\n")
>>> _ = (d / "cb.yaml").write_text("base: _cb.yaml\\ntrainer: {callbacks: {a: null, c: {class_path: C}}}\\n")
>>> load_config(d / "cb.yaml")
{'trainer': {'callbacks': [{'class_path': 'B'}, {'class_path': 'C'}]}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

BASE_KEY = "base"
#: ``base: deqscore:<path>`` names a config of this folder, wherever the config naming it is
SHIPPED_PREFIX = "deqscore:"
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class ConfigFileError(ValueError):
    """A config file that cannot be read, is not a mapping, or names a base that cannot be composed."""


def is_base(path: str | Path) -> bool:
    """A config that is only a base (its name starts with ``_``), composed into others, never run alone; any other
    config is runnable, and may be a base too."""
    return Path(path).name.startswith("_")


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in ``path``, or :class:`ConfigFileError` naming the file."""
    try:
        content = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigFileError(f"{path}: not a readable YAML file ({type(err).__name__}: {err})") from None
    if not isinstance(content, dict):
        what = "empty" if content is None else f"a YAML {type(content).__name__}"
        raise ConfigFileError(f"{path}: the file is {what}; a config is a mapping of options (seed_everything:, "
                              "trainer:, model:, data:, ...), see configs/")
    return content


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: mappings merged key by key, everything else replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    if "class_path" in out:  # first, as configs write it, whichever file gave it
        out = {"class_path": out.pop("class_path"), **out}
    return out


def load_config(path: str | Path) -> dict[str, Any]:
    """The options of the config at ``path`` with its bases composed in and its named callbacks listed (see the
    module docstring)."""
    return _listed(path, composed(path))


def composed_command_line(paths: list[str | Path]) -> tuple[list[str | None], dict[str, Any]]:
    """For config files given in this order on one command line (``--config a.yaml --config b.yaml``): each one's
    composed config as YAML text, or None for a file that needs no composing (:func:`composes`), and the named
    callbacks in force after the last file. A file's named callbacks compose on those of the files before it, by
    name as on a base's; the parser, which takes each file's list of callbacks in place of the one before, then holds
    them all. A file that lists its callbacks replaces them, as it would without composing."""
    texts, before = [], {}
    for path in paths:
        content = read_mapping(path)
        needs_composing = _composes(content)
        config = _composed(Path(path), content, ())
        if named_callbacks(config):
            before = config["trainer"]["callbacks"] = merged(before, config["trainer"]["callbacks"])
        elif isinstance(config.get("trainer"), dict) and config["trainer"].get("callbacks") is not None:
            before = {}
        texts.append(_text(_listed(path, config)) if needs_composing else None)
    return texts, before


def _listed(path: str | Path, config: dict[str, Any]) -> dict[str, Any]:
    if named_callbacks(config):
        callbacks = {name: c for name, c in config["trainer"]["callbacks"].items() if c is not None}
        for name, callback in callbacks.items():
            if not isinstance(callback, dict) or "class_path" not in callback:  # a misspelt name of a base's
                raise ConfigFileError(f"{path}: trainer.callbacks.{name} names no class_path; the callbacks with one "
                                      f"here: {', '.join(n for n in callbacks if n != name) or 'none'}")
        config["trainer"]["callbacks"] = list(callbacks.values())
    return config


def named_callback_options(argv: list[str], callbacks: dict[str, Any]) -> tuple[list[str], str | None]:
    """``argv`` without its options of the named ``callbacks`` (``--trainer.callbacks.ema.init_args.decay=0.99``),
    and the callbacks with those options set, as config text of the listed callbacks (None without any such option):
    jsonargparse would take the name as a key of the callbacks' list and drop the value unsaid. Any other
    ``--trainer.callbacks.X`` is jsonargparse's (``X``, an option of the last callback listed)."""
    callbacks = {name: callback for name, callback in callbacks.items() if callback is not None}
    rest: list[str] = []
    options: dict[str, Any] = {}
    tokens = iter(argv)
    for token in tokens:
        key, joined, value = token.partition("=")
        name = key.removeprefix("--trainer.callbacks.").split(".")[0] if key.startswith("--trainer.callbacks.") else ""
        if name not in callbacks:
            rest.append(token)
            continue
        value = value if joined else next(tokens, "")
        node = options.setdefault(name, {})
        *parents, leaf = key.removeprefix(f"--trainer.callbacks.{name}.").split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    if not options:
        return rest, None
    return rest, _text(_listed("--trainer.callbacks", {"trainer": {"callbacks": merged(callbacks, options)}}))


def named_callbacks(config: dict[str, Any]) -> bool:
    """Whether ``config`` writes the trainer's callbacks as a mapping of names."""
    trainer = config.get("trainer")
    return isinstance(trainer, dict) and isinstance(trainer.get("callbacks"), dict)


def composed(path: str | Path) -> dict[str, Any]:
    """The options of the config at ``path`` with its bases composed in, named callbacks still a mapping."""
    return _composed(Path(path), read_mapping(path), ())


def _composed(path: Path, content: dict[str, Any], seen: tuple[Path, ...]) -> dict[str, Any]:
    content = dict(content)
    return merged(_merged_bases(path, content.pop(BASE_KEY, []), seen), content)


def base_options(path: str | Path) -> dict[str, Any]:
    """What the config at ``path`` composes on: its bases, each composed, merged in order (empty without a base)."""
    return _merged_bases(Path(path), read_mapping(path).get(BASE_KEY, []), ())


def _merged_bases(path: Path, bases: str | list[str], seen: tuple[Path, ...]) -> dict[str, Any]:
    if path.resolve() in seen:
        raise ConfigFileError(f"{path}: its bases name it again ({' -> '.join(str(p) for p in seen)})")
    out: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else bases:
        base_path = base_file(path, base)
        out = merged(out, _composed(base_path, read_mapping(base_path), (*seen, path.resolve())))
    return out


def base_file(path: Path, base: str) -> Path:
    """The file that ``base``, named by the config at ``path``, stands for; :class:`ConfigFileError` in one line,
    saying what to write instead, when it is not there."""
    if not isinstance(base, str):
        raise ConfigFileError(f"{path}: base must be a file name or a list of them, got {base!r}")
    if base.startswith(SHIPPED_PREFIX):
        base_path = SHIPPED_CONFIGS / base[len(SHIPPED_PREFIX):]
        if not SHIPPED_CONFIGS.is_dir():
            raise ConfigFileError(f"{path}: its base {base} names the configs shipped with deqscore, but there are "
                                  f"none beside this installation ({SHIPPED_CONFIGS}); copy that file beside "
                                  f"{path.name} and name it by its file name")
        if not base_path.is_file():
            raise ConfigFileError(f"{path}: its base {base} is not a shipped config ({base_path})")
        return base_path
    base_path = path.parent / base
    if not base_path.is_file():
        raise ConfigFileError(f"{path}: its base {base} is not a file ({base_path}){_shipped_hint(path, base)}")
    return base_path


def _shipped_hint(path: Path, base: str) -> str:
    """What a config copied out of ``configs/`` writes instead of a relative base: the ``deqscore:`` path of the
    shipped file of that name (of the folder holding the file the config is a copy of, where several have that
    name)."""
    if not SHIPPED_CONFIGS.is_dir():
        return ""
    found = sorted(SHIPPED_CONFIGS.rglob(Path(base).name))
    if len(found) > 1:  # e.g. _mnist.yaml of several families: the one beside a file the config is a copy of
        text = path.read_bytes()
        found = [f for f in found if any(g.read_bytes() == text for g in f.parent.glob("*.yaml"))] or found
    if not found:
        return ""
    names = " or ".join(f"{BASE_KEY}: {SHIPPED_PREFIX}{f.relative_to(SHIPPED_CONFIGS).as_posix()}" for f in found)
    return f"; a config copied out of configs/ names a shipped base from anywhere: write {names}"


def composes(path: str | Path) -> bool:
    """Whether the config at ``path`` needs composing: it names a base or names its callbacks."""
    return _composes(read_mapping(path))


def _composes(content: dict[str, Any]) -> bool:
    return BASE_KEY in content or named_callbacks(content)


def composed_text(path: str | Path) -> str:
    """The composed config as YAML text (what the command line is given in place of a composing file)."""
    return _text(load_config(path))


def _text(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False)
