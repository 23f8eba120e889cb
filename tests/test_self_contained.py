"""The repository tests and runs on its own: no test or package file points outside the clone (a user has only the
clone), so a fresh clone with nothing beside it passes ``make test``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ways out of the clone: the sibling folder CI keeps, a parent reached by relative path or by climbing from ROOT
OUTSIDE = re.compile(r"""shared/data|["']\.\./|ROOT\.parent\b|parents\[(\d+)\]""")


def climbs_out(path: Path, line: str) -> bool:
    """Whether ``line`` of ``path`` names a path outside the repository (``parents[k]`` past the root counts)."""
    for match in OUTSIDE.finditer(line):
        if match.group(1) is None:
            return True
        root_index = len(path.relative_to(ROOT).parts) - 1  # parents[root_index] is the repository root
        if int(match.group(1)) > root_index:
            return True
    return False


def test_nothing_reads_outside_the_repository():
    files = [*ROOT.joinpath("tests").rglob("*.py"), *ROOT.joinpath("deqscore").rglob("*.py"),
             *ROOT.joinpath("lab").rglob("*.py"),
             *ROOT.joinpath("configs").rglob("*.yaml"), ROOT / "Makefile", ROOT / "train.py", ROOT / "sample.py"]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files if p != Path(__file__)
             for i, line in enumerate(p.read_text().splitlines(), 1) if climbs_out(p, line)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def test_the_check_sees_a_path_outside():
    inside, tests_file = ROOT / "lab" / "deqlab" / "study" / "core.py", ROOT / "tests" / "data" / "x.py"
    assert not climbs_out(inside, "ROOT = Path(__file__).resolve().parents[3]")
    assert climbs_out(inside, "ROOT = Path(__file__).resolve().parents[4]")
    assert climbs_out(tests_file, 'X = Path(__file__).resolve().parents[3] / "shared" / "data"')
    assert not climbs_out(tests_file, 'X = Path(__file__).resolve().parents[2] / "datasets" / "uci"')
    assert climbs_out(tests_file, 'DATA_ROOT = "../shared/data"')
    assert climbs_out(tests_file, 'UCI = ROOT.parent / "shared" / "data"')
