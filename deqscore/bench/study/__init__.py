"""The reproduction study: every variant of a family (shallow explicit, deep explicit, the DEQ and its reference
design) trained with the same budget over several seeds, evaluated on the test split through the project's own
commands, and written up from the recorded results alone.

Run::

    python -m deqscore.bench.study --family nice --seeds 0,1,2              # the default budget (about 3 CPU-hours)
    python -m deqscore.bench.study --family dkef,vae,ncsn --seeds 0,1,2 --budget 0.25
    python -m deqscore.bench.study --report                                 # docs/results.md from the unit files

Each (family, data set, variant, seed) is one unit: ``train.py fit`` of the variant's config with the family's
shared options for ``budget x`` the family's training iterations (run directory
``<runs-root>/<family>/<data>/<variant>_s<seed>``), then the family's evaluation of its final weights (see
:mod:`deqscore.bench.study.families`), recorded as ``<out>/<family>/<data>/<variant>_s<seed>.json``. A unit already
recorded with the same settings is read back instead of run again, so a study longer than one sitting continues
where it stopped (a run directory left by an interrupted unit is moved aside). A unit file holds one budget: a
unit recorded with other settings (budget, evaluation sizes, ``--extra``) is run again and replaced, so keep
studies at two budgets under two ``--out`` and ``--runs-root``. ``--set key=value`` changes an evaluation size
(e.g. ``--set samples=2000`` for NCSN; this re-runs the units); ``--extra`` passes arguments to every fit.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ..measure import environment
from .core import Family, run_unit
from .families import FAMILIES
from .report import write_page

__all__ = ["FAMILIES", "main"]


def chosen(parser: argparse.ArgumentParser, key: str, text: str, known: dict | list) -> list[str]:
    """The comma-separated names of ``text``; an unknown one is a parser error listing ``known``."""
    names = [v for v in text.split(",") if v]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        parser.error(f"{key}: unknown {unknown or text!r}; choose from {', '.join(known)}")
    return names


def evaluation_of(parser: argparse.ArgumentParser, family: Family, pairs: list[str]) -> dict:
    """The family's evaluation sizes with the ``key=value`` changes of ``--set`` that name one of them."""
    known = sorted({k for f in FAMILIES.values() for k in f.evaluation})
    evaluation = dict(family.evaluation)
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if key not in known or not equals:
            parser.error(f"--set {pair}: expected KEY=VALUE with KEY one of {', '.join(known)}")
        if key in evaluation:
            try:
                evaluation[key] = type(evaluation[key])(value)
            except ValueError:
                parser.error(f"--set {pair}: {key} takes a {type(evaluation[key]).__name__}, got {value!r}")
            accepted = family.choices.get(key)
            if accepted is not None and evaluation[key] not in accepted:
                parser.error(f"--set {pair}: {key} takes one of {', '.join(accepted)}")
    return evaluation


Plan = list[tuple[Family, list[str], list[str], dict]]  # (family, groups, variants, evaluation)


def plan_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Plan:
    """What to run, every option checked before anything runs (an error names the option and the choices)."""
    names = list(FAMILIES) if args.family == "all" else (
        chosen(parser, "--family", args.family, FAMILIES) if args.family else [])
    if not (math.isfinite(args.budget) and args.budget > 0):
        parser.error(f"--budget: a positive fraction of the default, got {args.budget}")
    plan = []
    for name in names:
        family = FAMILIES[name]
        variants = chosen(parser, "--variants", args.variants, family.variants) if args.variants else \
            list(family.variants)
        groups = chosen(parser, "--groups", args.groups, family.groups) if args.groups else list(family.groups)
        plan.append((family, groups, variants, evaluation_of(parser, family, args.set)))
    return plan


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="", help=f"comma-separated, from {', '.join(FAMILIES)}, or 'all'")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (seed_everything of each run)")
    parser.add_argument("--budget", type=float, default=1.0, help="fraction of each family's default iterations")
    parser.add_argument("--variants", default="", help="comma-separated (default: all of the family's)")
    parser.add_argument("--groups", default="", help="data sets (DKEF: redwine, whitewine, parkinsons)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an evaluation size")
    parser.add_argument("--runs-root", default="checkpoints/study")
    parser.add_argument("--out", default="benchmarks/results/study")
    parser.add_argument("--report", action="store_true", help="write --page from the unit files under --out")
    parser.add_argument("--page", default="docs/results.md")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="arguments passed to every fit")
    args = parser.parse_args(argv)
    if not args.family and not args.report:
        parser.error("--family: name the families to run (or 'all'), or give --report")
    if not args.family and not any(Path(args.out).glob("*/*/*.json")):  # a mistyped --out must not empty the page
        parser.error(f"--out {args.out}: no unit files (<family>/<data>/<variant>_s<seed>.json) to report on; "
                     f"name the folder the study wrote")
    plan = plan_of(parser, args)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        seeds = []
    if not seeds:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    out = Path(args.out)
    device = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))["device"]
    results = {
        family.name: [run_unit(family, group, variant, seed, args.budget, Path(args.runs_root), out, args.extra,
                               evaluation, device)
                      for group in groups for seed in seeds for variant in variants]  # seed by seed
        for family, groups, variants, evaluation in plan}
    if args.report:
        print(write_page(out, Path(args.page), list(FAMILIES.values())))
    return results
