"""``run()``: the benchmark sections, and their options on the command line (:mod:`deqlab.cli`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .measure import environment, log
from .report import Result, Table, write_result
from .sections import section_funcs
from .settings import DEFAULT_OUT, Settings, get_settings
from .targets import targets

TITLE = "deqscore benchmark"
SETTINGS_NOTE = ("The settings below are `lab/deqlab/settings.py`'s; the family sections build their networks from "
                 "the configs with the options given in their notes.")


def resolve_device(device: str | None) -> torch.device:
    """``cuda`` when available and not asked otherwise; asking for CUDA without one is an error."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but CUDA is not available")
    return dev


def check_sections(sections: Sequence[str] | None) -> list[str]:
    """The requested sections in benchmark order; unknown names raise."""
    known = list(section_funcs())
    if sections is None:
        return known
    unknown = sorted(set(sections) - set(known))
    if unknown:
        raise ValueError(f"unknown sections {unknown}; choose from {', '.join(known)}")
    return [name for name in known if name in sections]


def run(
    quick: bool = False,
    device: str | None = None,
    out_dir: str | Path = DEFAULT_OUT,
    sections: Sequence[str] | None = None,
    repeats: int | None = None,
    threads: int | None = None,
    command: str | None = None,
    trained_checkpoint: str | Path | None = None,
) -> dict:
    """Run the benchmark sections, write ``bench.md``/``bench.json`` to ``out_dir``, return the JSON document.

    ``threads`` sets torch's intra-op threads for the run (restored afterwards); default: leave them as they are.
    ``command`` (the command line, when run from it) is written into the header. ``trained_checkpoint``: a
    DEQ-NICE checkpoint whose trained coupling blocks are added to the solver comparison.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        settings = get_settings(quick, repeats, trained_checkpoint, str(out_dir))
        dev, names = resolve_device(device), check_sections(sections)
        return _run(settings, dev, Path(out_dir), names, {"command": command} if command else {})
    finally:
        torch.set_num_threads(previous)


def _run(settings: Settings, dev: torch.device, out_dir: Path, names: list[str], extra: dict) -> dict:
    flushing = settings.flush_denormal and torch.set_flush_denormal(True)
    try:
        return _run_sections(settings, dev, out_dir, names, {**extra, "flush denormals (CPU)": flushing})
    finally:
        torch.set_flush_denormal(False)


def _run_sections(settings: Settings, dev: torch.device, out_dir: Path, names: list[str], extra: dict) -> dict:
    start = time.perf_counter()
    env = environment(dev)  # before the sections: its load average is the one they start under
    tables: dict[str, Table] = {}
    funcs = section_funcs()
    for name in names:
        log(f"section {name} ({settings.mode})")
        tables[name] = funcs[name](settings, dev)
    header = {**extra, **env, "mode": settings.mode, "sections": ", ".join(names)}
    header["runtime"] = f"{time.perf_counter() - start:.0f} s"
    all_tables = [*tables.values(), targets(tables, settings)]
    doc = write_result(out_dir, "bench", Result(TITLE, header, settings.as_dict(), all_tables, notes=[SETTINGS_NOTE]))
    log(f"wrote {out_dir / 'bench.md'} and bench.json in {header['runtime']}")
    return doc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark sections' options (the top of ``python -m deqlab``'s parser tree, :mod:`deqlab.cli`)."""
    parser.add_argument("--quick", action="store_true", help="small sizes (CI/tests, a few seconds)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--sections", default=None, help=f"comma-separated subset of: {','.join(section_funcs())}")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per row (default: 5 full, 2 quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--trained-checkpoint", default=None,
                        help="DEQ-NICE checkpoint: also compare the solvers on its trained coupling blocks")


def run_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace, command: str) -> dict:
    """:func:`run` with the parsed options; a bad section or device is ``parser``'s one-line error."""
    sections = [s.strip() for s in args.sections.split(",") if s.strip()] if args.sections else None
    try:  # asked for on the command line: a usage error, not a traceback
        check_sections(sections)
    except ValueError as err:
        parser.error(f"--sections: {err}")
    try:
        resolve_device(args.device)
    except RuntimeError as err:
        parser.error(str(err))
    return run(quick=args.quick, device=args.device, out_dir=args.out, sections=sections, repeats=args.repeats,
               threads=args.threads, command=command, trained_checkpoint=args.trained_checkpoint)
