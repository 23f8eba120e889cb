"""``train.py`` that records, as the interpreter exits, whether this rank still holds a process group.

    EXIT_PROBE=DIR python exit_probe.py fit ...

Each rank writes ``DIR/rank<LOCAL_RANK>``: ``held`` or ``left``. Run by tests/lightning/test_ddp.py; Lightning's
launcher relaunches this script for the other ranks, with the environment.
"""

import atexit
import os
from pathlib import Path

import torch

from deqscore.cli.train import console


def record() -> None:
    held = torch.distributed.is_available() and torch.distributed.is_initialized()
    Path(os.environ["EXIT_PROBE"], f"rank{os.environ.get('LOCAL_RANK', '0')}").write_text("held" if held else "left")


if __name__ == "__main__":
    atexit.register(record)
    console()
