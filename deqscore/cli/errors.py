"""The one-line usage error of the command-line programs: ``<program>: error: <message>``, exit status 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn


class UsageError(SystemExit):
    """A usage mistake reported as one message (exit status 2)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


def print_error(message: str) -> None:
    """``<program>: error: <message>`` on stderr."""
    prog = Path(sys.argv[0]).name or "train.py"
    sys.stderr.write(f"{prog}: error: {message.rstrip()}\n")


def usage_error(message: str) -> NoReturn:
    """Print ``error: <message>`` to stderr and exit with status 2 (no traceback)."""
    print_error(message)
    raise UsageError(message)
