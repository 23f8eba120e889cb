"""``python -m deqlab gpu``: the one GPU command (``make gpu``), about 7.5 minutes on one GPU.

What it measures on a GPU, into ``--out`` (default ``benchmarks/results/gpu/``): ``gpu.md`` and ``gpu.json`` (the
same numbers, the card named in the header), one sample grid PNG per image network:

* **steps** (:mod:`deqlab.gpu_steps`): per family (NICE, DKEF, VAE, NCSN, and any family declared later),
  the explicit and the DEQ network's training step, eager and under ``torch.compile`` (a config that does not
  compile has its error in one line), the CUDA peak memory of a step, and the DEQ-over-explicit ratios;
* **images** (:mod:`deqlab.gpu_images`): each image family's explicit and DEQ network trained on MNIST at the
  configs' full scale for a time budget (the steps reached recorded), sampled with the configs' sampler, and scored
  by KID (with its standard error) and FID@N against held-out MNIST, beside the untrained network as the control.

Every stage has a time budget and is timed; a failing stage leaves its one-line error in the report and the next
stage runs. Without a CUDA device it stops with one line (status 2), unless ``--quick``: then every stage runs at tiny
sizes on the CPU in seconds (how the tests run it).

Run::

    python -m deqlab gpu [--out DIR] [--inception-weights FILE]
    python -m deqlab gpu --quick --out /tmp/gpu      # CPU, seconds
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .gpu_images import ImagePlan, image_table
from .gpu_steps import StepPlan, one_line, step_table
from .measure import environment, log
from .report import Result, Table, write_result

PROG = "python -m deqlab gpu"
DEFAULT_OUT = "benchmarks/results/gpu"

STEPS = {"full": StepPlan("full", repeats=10, backend="inductor", budget_s=60.0),
         "quick": StepPlan("quick", repeats=2, backend="eager", budget_s=6.0)}
IMAGES = {
    "full": ImagePlan(quick=False, train_s={"explicit": 50.0, "DEQ": 70.0}, max_steps=20_000, sample_s=30.0,
                      samples=500, min_samples=100, reference=10_000),
    "quick": ImagePlan(quick=True, train_s={"explicit": 5.0, "DEQ": 5.0}, max_steps=3, sample_s=30.0,
                       samples=10, min_samples=10, reference=10, fid=False),
}


def run_stages(quick: bool, out_dir: str | Path = DEFAULT_OUT, inception: str | None = None,
               command: str | None = None) -> dict:
    """Run the stages, write ``gpu.md`` / ``gpu.json`` to ``out_dir`` and return the JSON document."""
    mode = "quick" if quick else "full"
    device = torch.device("cuda" if torch.cuda.is_available() and not quick else "cpu")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True  # the GPU's float32 matmuls as training would run them
    torch.backends.cudnn.allow_tf32 = True
    header = {**({"command": command} if command else {}), **environment(device), "mode": mode}
    stages = {"steps": lambda: step_table(STEPS[mode], device),
              "images": lambda: image_table(IMAGES[mode], device, out, inception)}
    tables: list[Table] = []
    timings: dict[str, float] = {}
    start = time.perf_counter()
    settings = {"steps": asdict(STEPS[mode]), "images": asdict(IMAGES[mode])}
    doc: dict = {}
    for name, stage in stages.items():
        log(f"gpu: stage {name} ({mode}, {device})")
        t0 = time.perf_counter()
        try:
            tables.append(stage())
        except Exception as err:  # noqa: BLE001 - a failing stage is reported; the next one still runs
            failed = Table(name, f"{name}: failed", [])
            failed.notes.append(one_line(err))
            tables.append(failed)
            log(f"gpu: stage {name} {one_line(err)}")
        timings[name] = round(time.perf_counter() - t0, 1)
        header["stage seconds"] = timings
        header["runtime"] = f"{time.perf_counter() - start:.0f} s"
        # after every stage: a run stopped later keeps these
        doc = write_result(out, "gpu", Result("deqscore GPU benchmark", header, settings, tables))
    log(f"gpu: wrote {out / 'gpu.md'} and gpu.json in {header['runtime']}")
    return doc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU, seconds (the tests)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--inception-weights", default=None,
                        help="FID Inception weights file (default: found as deqscore.metrics.inception says)")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    if not args.quick and not torch.cuda.is_available():
        parser.error("no CUDA device: this program measures a GPU (--quick runs it at tiny sizes on the CPU)")
    if args.inception_weights is not None and not Path(args.inception_weights).is_file():
        parser.error(f"--inception-weights: no file at {args.inception_weights}")
    command = PROG + (" --quick" if args.quick else "")
    return run_stages(args.quick, args.out, args.inception_weights, command)
