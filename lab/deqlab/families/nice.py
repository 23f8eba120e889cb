"""Section ``nice``: explicit vs DEQ NICE (``configs/nice/*.yaml``), one SSM training step of the module as built
for training (``NICEModule.loss_terms``, forward and backward): parameters, activation memory, step time and the
DEQ solver iterations per coupling. Ratio rows divide each DEQ row by the explicit row with as many couplings.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deqscore.deq import DEQ
from deqscore.metrics import parameter_count

from ..configs import Options, Variant, build, options_text
from ..measure import StepResult, log, make_inputs, measure_step
from ..report import Column, Table, ratio_cells
from ..settings import MNIST_DIM, Settings
from ..study.core import Variant as StudyVariant
from ..study.evaluation import GRID, draw_samples, test_metrics

VARIANTS = (
    Variant("explicit, 4 couplings", "configs/nice/explicit.yaml"),
    Variant("DEQ, 4 couplings", "configs/nice/deq.yaml"),
    Variant("explicit, 2 couplings", "configs/nice/explicit.yaml", {"net.n_couplings": 2}),
    Variant("DEQ reference, 2 couplings", "configs/nice/deq_reference.yaml"),
)
RATIOS = (("DEQ, 4 couplings", "explicit, 4 couplings"), ("DEQ reference, 2 couplings", "explicit, 2 couplings"))
# The benchmark's options, the one place they are stated. Every timed step starts the solve from zeros: repeated
# steps on one batch would otherwise start at that batch's own fixed point.
DEQ_OPTIONS: Options = {"net.deq.warm_start": False}
SIZES: dict[str, Options] = {"full": {"net.dim": MNIST_DIM}, "quick": {"net.dim": 64, "net.hidden": 128}}
BATCH = {"full": 128, "quick": 32}


def options(s: Settings, variant: Variant) -> dict[str, object]:
    """The options a row is built with: the variant's, the mode's sizes and (DEQ) the solver's start."""
    deq = "deq" in variant.config
    return {**variant.options, **SIZES[s.mode], **(DEQ_OPTIONS if deq else {})}


def nice_row(s: Settings, variant: Variant, device: torch.device) -> dict:
    """One row: the module of ``variant`` and its step measured on the benchmark inputs."""
    module = build(variant.config, options(s, variant)).to(device).train()
    x, _ = make_inputs(BATCH[s.mode], module.net.dim, s, device, torch.float32)
    res: StepResult = measure_step(lambda: module.loss_terms(x)["loss"], module, device, s)
    iters = [m.stats.nstep for m in module.modules() if isinstance(m, DEQ)]
    row = {"model": variant.label, "config": variant.config, "params": parameter_count(module), **vars(res),
           "solver_iters": ", ".join(map(str, iters)) or None}
    log(f"nice: {variant.label}: {res.act_mib:.1f} MiB, {res.time_ms:.1f} ms, solver iterations {iters}")
    return row


def _step_columns(device: torch.device) -> list[Column]:
    cols = [Column("act_mib", "activation memory (MiB)", ".2f")]
    if device.type == "cuda":
        cols.append(Column("peak_mib", "CUDA peak (MiB)", ".1f"))
    return cols + [Column("time_ms", "step time (ms)", ".1f"), Column("repeats", "timed steps")]


def section(s: Settings, device: torch.device) -> Table:
    table = Table("nice", "4. NICE: explicit vs DEQ m-nets (one SSM training step)", [
        Column("model", "model"), Column("config", "config"), Column("params", "parameters", ","),
        *_step_columns(device), Column("solver_iters", "DEQ solver iterations (per coupling)"),
    ])
    rows = {v.label: nice_row(s, v, device) for v in VARIANTS}
    table.rows += rows.values()
    keys = ("params", "act_mib", "peak_mib", "time_ms")
    table.rows += [{"model": f"ratio {deq} / {explicit}", **ratio_cells(rows[deq], rows[explicit], keys)}
                   for deq, explicit in RATIOS]
    source = make_inputs(1, int(SIZES[s.mode]["net.dim"]), s, device, torch.float32)[1]
    table.meta["options"] = {v.label: options(s, v) for v in VARIANTS} | {"batch": BATCH[s.mode]}
    table.notes += [
        f"Each network is its config's module (`build_module` on `model:`), with the options: "
        f"{'; '.join(f'{v.label}: {options_text(options(s, v))}' for v in VARIANTS)}. Batch {BATCH[s.mode]}, "
        f"float32, inputs {source}.",
        "One step = `module.loss_terms(x)['loss']` (the config's loss) and its backward, no optimiser update. "
        "Activation memory: `loss_step_bytes`, the storages autograd saves in the forward and backward, "
        "parameters excluded (the figure training logs as run/activation_memory_mb).",
        "Ratio rows divide the DEQ row by the explicit row with as many couplings (parameters, memory, time). A DEQ "
        "m-net with K phantom steps records 2K hidden layers (2 per application of its map), whatever the solver "
        "iterations (section 1).",
    ]
    return table


def evaluate(run_dir: Path, checkpoint: Path, variant: StudyVariant, seed: int, evaluation: dict) -> dict:
    """The study's evaluation of a trained NICE run (see :mod:`deqlab.study.evaluation`)."""
    options = ["--model.init_args.exact_sm_batches=1",
               f"--model.init_args.exact_sm_samples={evaluation['exact_sm_images']}"]
    metrics = test_metrics(run_dir, checkpoint, options, ("log_likelihood", "bits_per_dim", "exact_sm", "loss"))
    draw_samples(checkpoint, run_dir / "samples", GRID, seed)
    return metrics
