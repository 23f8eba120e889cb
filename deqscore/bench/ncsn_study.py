"""A reduced-budget NCSN study on MNIST: the DEQ body and the shallow explicit body trained for the same steps,
then scored by FID at a stated number of samples.

Run::

    python -m deqscore.bench.ncsn_study                     # 600 steps each, FID of 500 samples (CPU: ~30 min)
    python -m deqscore.bench.ncsn_study --steps 100 --samples 100 --reference 500

Each variant is ``train.py fit`` on ``configs/ncsn/{deq,explicit}_mnist.yaml`` with the same overrides (steps, width,
batch, Langevin steps per level), followed by ``sample.py --fid`` on its last checkpoint (averaged weights) against
the statistics of the first ``--reference`` MNIST training images. The table (``ncsn_mnist_study.md`` / ``.json``
under ``--out``) holds, per variant: parameters, activation memory of one training step, seconds per step, the
final validation loss, sampling seconds and the FID. FIDs from a few hundred samples are far above large-sample
figures: compare the rows with each other, at the same N and reference.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from ..lightning.callbacks import read_metrics_csv
from .measure import environment
from .study import chosen_variants, write_study

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {"deq": "configs/ncsn/deq_mnist.yaml", "explicit": "configs/ncsn/explicit_mnist.yaml"}


def run_variant(name: str, args: argparse.Namespace) -> dict:
    """Fit then sample one variant with FID; its row."""
    from ..cli.sample import main as sample
    from ..cli.train import main as train

    warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")
    runs_root = Path(args.runs_root)
    overrides = [f"--model.init_args.net.init_args.ngf={args.ngf}", f"--data.init_args.batch_size={args.batch}",
                 f"--model.init_args.sampler.init_args.n_steps_each={args.langevin_steps}",
                 f"--trainer.max_steps={args.steps}", "--trainer.max_epochs=-1", "--trainer.limit_val_batches=4",
                 f"--trainer.val_check_interval={min(args.steps, 200)}", "--trainer.check_val_every_n_epoch=null",
                 "--trainer.enable_progress_bar=false", "--overwrite_run=true", *args.extra]
    start = time.perf_counter()
    fit = train(["fit", f"--config={ROOT / VARIANTS[name]}", f"--run_name=ncsn_{name}", f"--runs_root={runs_root}",
                 *overrides])
    fit_seconds = time.perf_counter() - start
    run_dir = runs_root / f"ncsn_{name}"
    start = time.perf_counter()
    sample(["--checkpoint", str(run_dir / "checkpoints" / "last.ckpt"), "--num-samples", str(args.samples),
            "--batch-size", str(args.sample_batch), "--out", str(run_dir / "samples"), "--fid",
            "--reference-images", str(args.reference), "--seed", "0", "--stats-root", args.stats_root])
    sample_seconds = time.perf_counter() - start
    report = json.loads((run_dir / "samples" / "fid.json").read_text())
    series = read_metrics_csv(run_dir / "metrics.csv")
    return {
        "variant": name, "config": VARIANTS[name], "overrides": " ".join(overrides), "steps": fit.trainer.global_step,
        "parameters": int(series["run/parameters"][-1][1]),
        "activation_memory_mb": series["run/activation_memory_mb"][-1][1],
        "seconds_per_step": fit_seconds / max(fit.trainer.global_step, 1),
        "val_loss": series["val/loss"][-1][1], "sample_seconds": sample_seconds,
        "fid": report["fid"], "fid_samples": report["num_samples"], "reference": report["reference"],
    }


def to_markdown(rows: list[dict], env: dict) -> str:
    lines = ["# NCSN study on MNIST (reduced budget)", ""]
    lines += [f"* **{k}**: {v}" for k, v in env.items()]
    lines += ["", "| body | steps | parameters | activation memory (MiB) | s / step | val loss (averaged weights) | "
              "sampling (s) | FID | FID samples |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['steps']} | {r['parameters']:,} | {r['activation_memory_mb']:.1f} | "
                     f"{r['seconds_per_step']:.3f} | {r['val_loss']:.4f} | {r['sample_seconds']:.0f} | "
                     f"{r['fid']:.2f} | {r['fid_samples']} |")
    lines += ["", f"* FID against {rows[0]['reference']} (Inception pool3, torch-fidelity's resize; grey repeated to "
              "RGB); samples by annealed Langevin dynamics with the final denoising step, averaged (EMA) weights.",
              "* s / step: wall clock of `fit` divided by its steps (validation and checkpointing included); "
              "activation memory: tensors saved for backward by one training step."]
    lines += [f"* {r['variant']}: `{r['config']}` {r['overrides']}" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="training steps of each variant")
    parser.add_argument("--ngf", type=int, default=32, help="base width of both bodies")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--langevin-steps", type=int, default=5, help="Langevin steps per noise level")
    parser.add_argument("--samples", type=int, default=500, help="N, samples scored by FID")
    parser.add_argument("--sample-batch", type=int, default=250)
    parser.add_argument("--reference", type=int, default=1000, help="MNIST training images of the FID reference")
    parser.add_argument("--variants", default="deq,explicit")
    parser.add_argument("--runs-root", default="checkpoints/study")
    parser.add_argument("--stats-root", default="datasets/fid_stats", help="cache of the reference statistics")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="arguments passed to every fit")
    args = parser.parse_args(argv)
    names = chosen_variants(parser, args.variants, VARIANTS)
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rows = [run_variant(name, args) for name in names]
    write_study(args.out, "ncsn_mnist_study", rows, env, to_markdown(rows, env))
    return rows


if __name__ == "__main__":
    main()
