"""The installed commands do what train.py and sample.py do."""

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("command", ["deqscore-train", "deqscore-sample"])
def test_console_commands_are_installed_and_run(command, tmp_path):
    path = BIN / command
    if not path.is_file():
        pytest.skip(f"{command} is not installed beside {sys.executable} (make installs the package)")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    args = ["fit", "--config", str(empty)] if command == "deqscore-train" else [
        "--checkpoint", str(empty), "--out", str(tmp_path / "out")]
    done = subprocess.run([str(path), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and str(empty) in done.stderr and "Traceback" not in done.stderr, done.stderr
