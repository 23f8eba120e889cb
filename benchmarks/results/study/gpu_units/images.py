"""The image families' study units on a many-core machine: each tuned arm's tuning runs first (one process per
rate), then one process per unit (``python -m deqlab study --variants V --seeds S``, which reads the tuning back),
at most ``--jobs`` at a time, seed 0 of every arm first. Stops starting jobs at ``--deadline`` seconds and kills
what still runs at ``--deadline + --grace``; what finished is recorded under ``--out`` as the study records it.

    python .gpurun/images.py --out /tmp/study --runs-root /tmp/runs [-- study options such as --budget 0.01]
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch


def tune(family_name: str, variant: str, rate: float, study_args: list[str]) -> None:
    """The tuning runs of one arm at one rate, exactly as the study's ``chosen_rate`` runs them."""
    from deqlab.measure import code_version, environment
    from deqlab.study import program
    from deqlab.study.core import import_run_code, run_unit
    from deqlab.study.protocol import load

    parser = argparse.ArgumentParser()
    program.add_arguments(parser)
    args = parser.parse_args(["--family", family_name, "--variants", variant, *study_args])
    protocol = load(args.protocol)
    family, groups, _, settings = program.plan_of(parser, args, protocol)[0]
    import_run_code()
    torch.set_num_threads(protocol.text["threads"])
    device = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    facts = {"device": device["device"], "code": code_version(), "threads": torch.get_num_threads(),
             "torch": torch.__version__}
    rule = protocol.family(family_name)["learning_rate"]
    for seed in protocol.text["learning_rate"]["tuning_seeds"]:
        run_unit(family, groups[0], variant, seed, settings, Path(args.runs_root), Path(args.out), facts,
                 learning_rate=(rule["option"], rate), kind="tuning")


ARMS = {"ncsn": {"explicit": 5, "deq": 5, "ncsnv2": 3, "untrained": 3}, "edm": {"explicit": 5, "deq": 5, "untrained": 3}}


def jobs(study_args: list[str], only: str = "", reruns: bool = True) -> list[tuple[str, list[str], list[str]]]:
    """(name, command, names it waits for), in start order; ``only``: comma-separated family:variant arms."""
    grid = [0.0001, 0.0003, 0.001]
    chosen = {tuple(a.split(":")) for a in only.split(",") if a}
    arms = {f: {v: n for v, n in vs.items() if not chosen or (f, v) in chosen} for f, vs in ARMS.items()}
    arms = {f: vs for f, vs in arms.items() if vs}
    me = [sys.executable, __file__]
    study = [sys.executable, "-m", "deqlab", "study"]
    out = []
    for family, variants in arms.items():
        for variant in variants:
            if variant != "untrained":
                out += [(f"tune {family} {variant} {r}", [*me, "--tune", family, variant, str(r), "--", *study_args],
                         []) for r in grid]
    untrained = [(f, s) for f in arms for s in range(arms[f].get("untrained", 0))]
    for seed in range(5):
        if seed == 2:  # the controls after two seeds of every trained arm
            out += [(f"{f} untrained s{s}", [*study, "--family", f, "--variants", "untrained", "--seeds", str(s),
                                             *study_args], []) for f, s in untrained]
        for family, variants in arms.items():
            for variant, n in variants.items():
                if seed < n and variant != "untrained":
                    waits = [] if variant == "untrained" else [f"tune {family} {variant} {r}" for r in grid]
                    out.append((f"{family} {variant} s{seed}",
                                [*study, "--family", family, "--variants", variant, "--seeds", str(seed),
                                 *study_args], waits))
        if seed == 0 and reruns:
            for family in [f for f in arms if "explicit" in arms[f]]:
                out.append((f"{family} rerun explicit s0", [*study, "--family", family, "--variants", "explicit",
                                                            "--seeds", "0", "--rerun", *study_args],
                            [f"tune {family} explicit {r}" for r in grid]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tune", nargs=3)
    parser.add_argument("--jobs", type=int, default=14)
    parser.add_argument("--deadline", type=float, default=480)
    parser.add_argument("--grace", type=float, default=60)
    parser.add_argument("--logs", default="/tmp/unit_logs")
    parser.add_argument("--only", default="", help="comma-separated family:variant arms (default: every arm)")
    parser.add_argument("--no-reruns", action="store_true")
    parser.add_argument("study", nargs="*")
    args = parser.parse_args()
    if args.tune:
        family, variant, rate = args.tune
        tune(family, variant, float(rate), args.study)
        return
    start = time.time()
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    pending, running, done = jobs(args.study, args.only, not args.no_reruns), {}, {}
    while pending or running:
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                done[name] = proc.returncode
                print(f"{time.time() - start:6.0f} s  rc {proc.returncode}  {name}", flush=True)
                del running[name]
        late = time.time() - start > args.deadline
        if late:
            pending = []
        if time.time() - start > args.deadline + args.grace:
            for name, proc in running.items():
                proc.kill()
                print(f"{time.time() - start:6.0f} s  killed  {name}", flush=True)
            break
        for job in list(pending):
            name, command, waits = job
            if len(running) >= args.jobs:
                break
            if any(done.get(w, None) not in (0,) for w in waits):
                if any(w in done and done[w] != 0 for w in waits):
                    pending.remove(job)
                    print(f"skipped (a tuning run failed)  {name}", flush=True)
                continue
            log = open(Path(args.logs) / (name.replace(" ", "_") + ".log"), "w")
            running[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            pending.remove(job)
            print(f"{time.time() - start:6.0f} s  start  {name}", flush=True)
        time.sleep(2)
    print(f"{time.time() - start:6.0f} s  finished {sum(rc == 0 for rc in done.values())} of {len(done)}")


if __name__ == "__main__":
    main()
