"""`make test` runs the suite on two workers with ``--dist loadgroup``: the tests of one ``xdist_group`` (those that
start processes of their own, a module whose module fixture is costly) must share a worker. Some pytest and
pytest-xdist releases together drop the group without a word (xdist writes the group into a node id that pytest
9.2 no longer reads), so the installed pair is checked on a suite of its own."""

from __future__ import annotations

import os
import subprocess
import sys

GROUPED_SUITE = """
import os
import time

import pytest


@pytest.mark.parametrize("case", range(6))
@pytest.mark.xdist_group("together")
def test_grouped(case):
    time.sleep(0.2)  # long enough that an idle worker would take the next case
    with open(os.environ["WORKERS_FILE"], "a") as f:
        f.write(f"{case} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""


def test_the_tests_of_one_group_share_a_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED_SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # none of this repository's options
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                           "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=os.environ | {"WORKERS_FILE": str(tmp_path / "workers")})
    assert done.returncode == 0, done.stdout + done.stderr
    workers = dict(line.split() for line in (tmp_path / "workers").read_text().splitlines())
    assert sorted(workers) == [str(c) for c in range(6)]
    assert len(set(workers.values())) == 1, f"one group ran on several workers: {workers}"
