"""The one-line usage error of the command-line programs: ``<program>: error: <message>``, exit status 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from ..data.errors import CorruptDataError, DataNotFoundError
from ..errors import ConfigError

# a user's mistake (an option, the data's place or content): one line, no traceback, in every program that runs a
# fit (train.py, the study)
USAGE_ERRORS = (ConfigError, DataNotFoundError, CorruptDataError)


class UsageError(SystemExit):
    """A usage mistake reported as one message (exit status 2)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


def print_error(message: str, prog: str | None = None) -> None:
    """``<program>: error: <message>`` on stderr (``prog``, or the name of the script that runs)."""
    prog = prog or Path(sys.argv[0]).name or "train.py"
    sys.stderr.write(f"{prog}: error: {message.rstrip()}\n")


def usage_error(message: str, prog: str | None = None) -> NoReturn:
    """Print ``<program>: error: <message>`` to stderr and exit with status 2 (no traceback)."""
    print_error(message, prog)
    raise UsageError(message)


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser that reports a mistake as one line naming its program (no usage block), as train.py does."""

    def error(self, message: str) -> NoReturn:
        usage_error(message, self.prog)
