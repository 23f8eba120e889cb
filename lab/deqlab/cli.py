"""``python -m deqlab``: the laboratory's one command line, one parser tree.

Without a program name it runs the benchmark sections (:mod:`deqlab.runner`, the options at the top of the tree);
``python -m deqlab <program> [its options]`` runs one of :data:`PROGRAMS`, each a sub-parser of the same tree
(``python -m deqlab <program> --help``). A program module gives ``add_arguments(parser)``, which fills its
sub-parser, and ``run(parser, args)``; none of them has a command line of its own. A mistake is one line naming
the program (``python -m deqlab study: error: ...``), exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from deqscore.cli.errors import OneLineParser

from . import deq_vs_ffn, gpu, runner, sync
from .kernels import regression
from .study import program as study

PROG = "python -m deqlab"

#: the laboratory's programs besides the benchmark sections, by the name that runs them
PROGRAMS: dict[str, ModuleType] = {
    "study": study,  # the reproduction study under its protocol
    "deq_vs_ffn": deq_vs_ffn,  # DEQ against feed-forward networks on steep functions
    "kernels": regression,  # kernel regression with the DEQ kernels
    "sync": sync,  # host syncs and the sync-free step
    "gpu": gpu,  # the one GPU command (make gpu): step rows per family, image families trained to digits
}


def parser_tree() -> tuple[OneLineParser, dict[str, OneLineParser]]:
    """The top parser (the benchmark sections' options) and each program's sub-parser, by name."""
    import deqlab

    top = OneLineParser(prog=PROG, description=deqlab.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner.add_arguments(top)
    subparsers = top.add_subparsers(dest="program", metavar="program", parser_class=OneLineParser)
    programs = {}
    for name, module in PROGRAMS.items():
        programs[name] = subparsers.add_parser(
            name, prog=f"{PROG} {name}", help=(module.__doc__ or "").strip().split("\n")[0],
            description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(programs[name])
    return top, programs


def main(argv: Sequence[str] | None = None) -> object:
    """Parse ``argv`` with the one tree and run what it names; returns what the program returns."""
    argv = sys.argv[1:] if argv is None else list(argv)
    top, programs = parser_tree()
    args, unknown = top.parse_known_args(argv)
    parser = programs.get(args.program, top)
    if unknown:  # named by the program they were given to
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.program is None:
        return runner.run_parsed(top, args, command=" ".join([PROG, *argv]))
    return PROGRAMS[args.program].run(parser, args)
