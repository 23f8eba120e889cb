"""Floors that read top-down: a package imports only from the floors below it (docs/contributing.md, "The
layers"). Checked on the import statements of every module, so a new upward import fails here. The laboratory
(``lab/``, package ``deqlab``) sits above the whole library: no library module names it, in an import or in a
string a dynamic import could read."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "deqscore"
# floor of each subpackage (a module may import its own floor and every lower one)
FLOORS = {"errors": 0, "files": 0, "finite": 0, "configfiles": 0, "privates": 0, "deq": 1, "losses": 1, "data": 1,
          "metrics": 2, "families": 1, "sampling": 2, "models": 3, "lightning": 4, "cli": 6}


def _imported_subpackages(path: Path, package: Path = PACKAGE) -> set[str]:
    """The deqscore subpackages ``path`` imports (absolute ``deqscore.x`` or relative ``..x`` / ``.x``)."""
    tree = ast.parse(path.read_text())
    own = path.relative_to(package).parts
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's own package
                base = list(own[:-1])[: len(own) - node.level]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [".".join(["deqscore", *target])] if target else [
                    f"deqscore.{alias.name}" for alias in node.names]
            elif node.module:
                names = [node.module]
        found |= {n.split(".")[1] for n in names if n.startswith("deqscore.") and len(n.split(".")) > 1}
    return found


def _floor(part: str) -> int:
    return FLOORS[part.removesuffix(".py")]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_from_a_higher_floor(path):
    own = path.relative_to(PACKAGE).parts[0]
    if own == "__init__.py" or own == "__main__.py":
        return
    upward = [sub for sub in _imported_subpackages(path) if sub in FLOORS and _floor(sub) > _floor(own)]
    assert not upward, f"{path.relative_to(PACKAGE)} imports from a higher floor: {upward}"


def test_the_scan_sees_relative_and_absolute_imports(tmp_path):
    module = tmp_path / "deqscore" / "sampling" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("from ..lightning import ScoreModule\nimport deqscore.cli.train\nfrom .grid import x\n")
    assert _imported_subpackages(module, tmp_path / "deqscore") == {"lightning", "cli", "sampling"}


LAB = re.compile(r"\bdeqlab\b")


def _names_the_laboratory(path: Path) -> list[str]:
    return [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if LAB.search(line)]


def test_the_library_never_names_the_laboratory():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _names_the_laboratory(path)]
    assert not found, "the library names the laboratory:\n" + "\n".join(found)


def test_the_laboratory_check_sees_a_dynamic_import(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text('import importlib\nsection = importlib.import_module("deqlab.families.nice").section\n')
    assert _names_the_laboratory(module) == [f"probe.py:2: {module.read_text().splitlines()[1]}"]


MAX_LINES = 450  # a module longer than this holds more than one idea: split it (docs/contributing.md)


def test_no_module_is_over_450_lines():  # the library's and the laboratory's
    lengths = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines())
               for p in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "lab" / "deqlab").rglob("*.py")]}
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}
    assert max(lengths.values()) > MAX_LINES / 2  # the scan reads the modules themselves
