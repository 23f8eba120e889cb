"""``python -m deqlab study``: the reproduction study's command line (:mod:`deqlab.study`)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from deqscore.cli.errors import USAGE_ERRORS

from ..measure import code_version, environment
from .core import Family, Plan, UnitSettings, import_run_code, rerun_path, run_unit, unit_path
from .families import families
from .parallel import jobs_of, run_jobs
from .protocol import Protocol, ProtocolError, load
from .report import write_page
from .tuning import chosen_rate, tuning_rule, tuning_runs


def chosen(parser: argparse.ArgumentParser, key: str, text: str, known: dict | list) -> list[str]:
    """The comma-separated names of ``text``; an unknown one is a parser error listing ``known``."""
    names = [v for v in text.split(",") if v]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        parser.error(f"{key}: unknown {unknown or text!r}; choose from {', '.join(known)}")
    return names


def evaluation_of(parser: argparse.ArgumentParser, protocol: Protocol, family: Family, pairs: list[str]) -> dict:
    """The protocol's evaluation sizes of ``family`` with the ``key=value`` changes of ``--set`` that name one."""
    known = sorted({k for f in families() for k in protocol.family(f)["evaluation"]})
    evaluation = dict(protocol.family(family.name)["evaluation"])
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


def seeds_of(parser: argparse.ArgumentParser, text: str) -> list[int] | None:
    """``--seeds``: comma-separated integers; None when not given (the protocol's)."""
    if text is None:
        return None
    try:
        seeds = [int(s) for s in text.split(",") if s]
    except ValueError:
        seeds = []
    if not seeds:
        parser.error(f"--seeds takes comma-separated integers, got {text!r}")
    return seeds


def plan_of(parser: argparse.ArgumentParser, args: argparse.Namespace, protocol: Protocol) -> Plan:
    """What to run, every option checked before anything runs (an error names the option and the choices)."""
    declared = families()
    names = list(declared) if args.family == "all" else (
        chosen(parser, "--family", args.family, declared) if args.family else [])
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        parser.error(f"--budget: a positive fraction of the default, got {args.budget}")
    if args.jobs < 1:
        parser.error(f"--jobs: a number of processes, at least 1, got {args.jobs}")
    seeds = seeds_of(parser, args.seeds)
    plan = []
    for name in names:
        family, entry = declared[name], protocol.family(name)
        variants = chosen(parser, "--variants", args.variants, family.variants) if args.variants else \
            [v for v in family.variants if protocol.seeds(name, v)]
        groups = chosen(parser, "--groups", args.groups, family.groups) if args.groups else list(family.groups)
        settings = UnitSettings(protocol, args.budget if args.budget is not None else entry["budget"],
                                protocol.validations, evaluation_of(parser, protocol, family, args.set),
                                tuple(entry["fit"]), tuple(args.extra), tune=not args.config_rates)
        plan.append((family, groups, {v: seeds or protocol.seeds(name, v) for v in variants}, settings))
    return plan


def units_in_order(groups: list[str], seeds: dict[str, list[int]]) -> list[tuple[str, str, int]]:
    """(group, variant, seed) group by group, seed by seed, each seed's variants in order."""
    return [(group, variant, seed) for group in groups for seed in sorted({s for v in seeds.values() for s in v})
            for variant, chosen_seeds in seeds.items() if seed in chosen_seeds]


def run_plan(plan: Plan, runs_root: Path, out: Path, kind: str, tune_rate: float | None = None
             ) -> dict[str, list[dict]]:
    """Every unit of ``plan`` in order (:func:`units_in_order`), each arm's learning rate chosen first
    (:func:`.tuning.chosen_rate`); ``kind``: ``unit``, or ``rerun`` to record them again under ``reruns/``. With
    ``tune_rate``, only the tuned arms' tuning runs at that rate (a job of :mod:`.parallel`)."""
    device = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    facts = {"device": device["device"], "cpu_instructions": device["cpu instructions"], "code": code_version(),
             "threads": torch.get_num_threads(), "torch": torch.__version__}
    results: dict[str, list[dict]] = {}
    for family, groups, seeds, settings in plan:
        results[family.name] = []
        if tune_rate is not None:
            for group, variant in [(g, v) for g in groups for v in seeds if tuning_rule(family, v, settings)]:
                results[family.name] += tuning_runs(family, group, variant, tune_rate, settings, runs_root, out,
                                                    facts)
            continue
        for group, variant, seed in units_in_order(groups, seeds):
            rate = chosen_rate(family, group, variant, settings, runs_root, out, facts)
            results[family.name].append(run_unit(family, group, variant, seed, settings, runs_root, out, facts,
                                                 rate, kind))
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", default="", help=f"comma-separated, from {', '.join(families())}, or 'all'")
    parser.add_argument("--protocol", default=None, help="protocol file (default: the newest in benchmarks/protocol)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds of every variant (default: the "
                                                       "protocol's, per variant)")
    parser.add_argument("--budget", type=float, default=None,
                        help="fraction of each family's default iterations (default: the protocol's)")
    parser.add_argument("--variants", default="", help="comma-separated (default: the protocol's)")
    parser.add_argument("--groups", default="", help="data sets (DKEF: redwine, whitewine, parkinsons)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an evaluation size")
    parser.add_argument("--runs-root", default="checkpoints/study")
    parser.add_argument("--out", default="benchmarks/results/study")
    parser.add_argument("--report", action="store_true", help="write --page from the unit files under --out")
    parser.add_argument("--page", default="docs/results.md")
    parser.add_argument("--config-rates", action="store_true",
                        help="train every arm at its config's learning rate, without the protocol's tuning (a trial)")
    parser.add_argument("--rerun", action="store_true",
                        help="run the named units again, recorded under <data>/reruns/ (the run-to-run spread)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="units run at once, each in a process of its own (default 1: one after another)")
    parser.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                        help="with --jobs: start no job after this many seconds (the ones under way finish)")
    parser.add_argument("--tune-rate", type=float, default=None, help=argparse.SUPPRESS)  # a job of --jobs
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="arguments passed to every fit")


def shared_arguments(args: argparse.Namespace) -> list[str]:
    """The options of ``args`` that every job of ``--jobs`` takes as they are (``--extra`` last)."""
    shared = ["--runs-root", args.runs_root, "--out", args.out]
    shared += ["--protocol", args.protocol] if args.protocol else []
    shared += ["--budget", repr(args.budget)] if args.budget is not None else []
    shared += [a for pair in args.set for a in ("--set", pair)]
    shared += ["--config-rates"] if args.config_rates else []
    shared += ["--rerun"] if args.rerun else []
    return shared + (["--extra", *args.extra] if args.extra else [])


def run_in_processes(plan: Plan, args: argparse.Namespace) -> dict[str, list[dict]]:
    """The units of ``plan`` in ``args.jobs`` processes (:mod:`.parallel`), read back from their files; a job that
    failed ends the call with one line naming it and its log."""
    log_dir = Path(args.runs_root) / "jobs"
    ended = run_jobs(jobs_of(plan), shared_arguments(args), args.jobs, log_dir, args.stop_after,
                     gpus=torch.cuda.device_count())
    failed = [name for name, code in ended.items() if code not in (0, None)]
    if unstarted := [name for name, code in ended.items() if code is None]:
        print(f"[study] {len(unstarted)} of {len(ended)} jobs not started (--stop-after passed, or their arm's "
              f"tuning failed): run the same command again to continue", flush=True)
    if failed:
        raise SystemExit(f"study: {len(failed)} of {len(ended)} jobs failed ({', '.join(failed)}); their output is "
                         f"in {log_dir}")
    kind = "rerun" if args.rerun else "unit"
    results: dict[str, list[dict]] = {}
    for family, groups, seeds, _ in plan:
        paths = [unit_path(Path(args.out), family.name, g, v, s) for g, v, s in units_in_order(groups, seeds)]
        paths = [rerun_path(p) if kind == "rerun" else p for p in paths]
        results[family.name] = [json.loads(p.read_text()) for p in paths if p.exists()]
    return results


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Run the units ``args`` asks for (and write the page with ``--report``); a usage mistake is ``parser``'s
    one-line error."""
    if not args.family and not args.report:
        parser.error("--family: name the families to run (or 'all'), or give --report")
    if not args.family and not any(Path(args.out).glob("*/*/*.json")):  # a mistyped --out must not empty the page
        parser.error(f"--out {args.out}: no unit files (<family>/<data>/<variant>_s<seed>.json) to report on; "
                     f"name the folder the study wrote")
    try:
        protocol = load(args.protocol)
    except ProtocolError as err:
        parser.error(str(err))
    plan = plan_of(parser, args, protocol)
    in_processes = args.jobs > 1 and bool(plan)  # each job imports and sets what it runs with
    out = Path(args.out)
    threads = torch.get_num_threads()
    if plan and not in_processes:
        import_run_code()
        if protocol.text.get("threads"):  # a unit's numbers depend on the thread count: the protocol fixes it
            torch.set_num_threads(protocol.text["threads"])
    try:
        if in_processes:
            results = run_in_processes(plan, args)
        else:
            results = run_plan(plan, Path(args.runs_root), out, "rerun" if args.rerun else "unit", args.tune_rate)
    # a recorded unit that cannot be kept, a unit another process runs, an option or data a fit cannot use: one
    # line, nothing recorded (a unit stopped before its first checkpoint is moved aside by the next study)
    except (ProtocolError, *USAGE_ERRORS) as err:
        parser.error(str(err))
    finally:
        torch.set_num_threads(threads)
    if args.report:
        try:
            print(write_page(out, Path(args.page), list(families().values()), protocol))
        except ProtocolError as err:
            parser.error(str(err))
    return results
