"""``python -m deqlab study --jobs N``: a study's units in N processes at once, for a machine with more cores than
one unit uses (each unit runs on the protocol's one thread), or a GPU that one unit leaves idle.

Each tuned arm's tuning runs come first, one process per rate of its grid; then each unit runs in a process of its
own, ``python -m deqlab study`` with one data set, variant and seed, which reads its arm's tuning back. The units
start seed by seed, every unit of an arm after its arm's tuning; an untuned arm (a control) waits for nothing. A
process records exactly what the same unit records in one process, and what is recorded is read back as always:
a call that stopped continues where it stopped. ``--stop-after`` starts no job after that many seconds (the ones
under way finish), to fit a lease of a machine; each job's output is in ``<runs-root>/jobs/``. On a machine with
several GPUs, each job sees one of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .core import Plan
from .tuning import tuning_rule


@dataclass
class Job:
    name: str
    arguments: list[str]  # of ``python -m deqlab study``, the options the jobs share left out
    waits: list[str] = field(default_factory=list)  # the jobs that must end well first


def jobs_of(plan: Plan) -> list[Job]:
    """Every tuning rate of every tuned arm, then every unit, seed by seed (each seed's units in the plan's order)."""
    tunings: list[Job] = []
    units: list[tuple[int, Job]] = []
    for family, groups, seeds, settings in plan:
        for group in groups:
            for variant, variant_seeds in seeds.items():
                one = ["--family", family.name, "--groups", group, "--variants", variant]
                rule = tuning_rule(family, variant, settings)
                rates = [] if rule is None else rule["grid"]
                waits = [f"tune {family.name} {group} {variant} {rate!r}" for rate in rates]
                tunings += [Job(name, [*one, "--tune-rate", repr(rate)])
                            for name, rate in zip(waits, rates, strict=True)]
                units += [(seed, Job(f"{family.name} {group} {variant} s{seed}", [*one, "--seeds", str(seed)], waits))
                          for seed in variant_seeds]
    return tunings + [job for _, job in sorted(units, key=lambda pair: pair[0])]


STUDY = [sys.executable, "-m", "deqlab", "study"]


def run_jobs(jobs: list[Job], shared: list[str], processes: int, log_dir: Path, stop_after: float | None = None,
             gpus: int = 0, program: list[str] = STUDY) -> dict[str, int | None]:
    """Run ``jobs`` (each ``program`` with its arguments and the options ``shared``, which end with ``--extra``
    where given) at most ``processes`` at once; each job's return code, None for one not started (its tuning
    failed, or ``stop_after`` passed). With several ``gpus``, each job sees one (``CUDA_VISIBLE_DEVICES``), the one
    that the fewest running jobs use. Progress, one line a job, on stdout."""
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    pending, running, ended = list(jobs), {}, {}
    on_gpu: dict[str, int] = {}

    def say(what: str, name: str) -> None:
        print(f"[study] {time.monotonic() - start:7.0f} s  {what:<8} {name}", flush=True)

    while pending or running:
        for name, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                on_gpu.pop(name, None)
                ended[name] = proc.returncode
                say("done" if proc.returncode == 0 else f"rc {proc.returncode}", name)
                del running[name]
        if stop_after is not None and time.monotonic() - start > stop_after:
            pending = []
        for job in list(pending):
            if len(running) >= processes:
                break
            if any(ended[w] != 0 for w in job.waits if w in ended):
                pending.remove(job)
                say("skipped", f"{job.name} (its arm's tuning failed)")
            elif all(w in ended for w in job.waits):
                log = (log_dir / (job.name.replace(" ", "_") + ".log")).open("w")
                env = None
                if gpus > 1:
                    on_gpu[job.name] = min(range(gpus), key=lambda g: (list(on_gpu.values()).count(g), g))
                    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(on_gpu[job.name])}
                running[job.name] = (subprocess.Popen([*program, *job.arguments, *shared], stdout=log,
                                                      stderr=subprocess.STDOUT, env=env), log)
                pending.remove(job)
                say("start", job.name + (f" (GPU {on_gpu[job.name]})" if job.name in on_gpu else ""))
        time.sleep(0.5)
    return {job.name: ended.get(job.name) for job in jobs}
