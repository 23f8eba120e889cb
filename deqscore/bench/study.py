"""A reduced-budget NICE study: train explicit and DEQ NICE with the same loss, then test each.

Run::

    python -m deqscore.bench.study                          # 2 epochs per variant at the paper's sizes
    python -m deqscore.bench.study --epochs 1 --variants explicit_ssm,deq_ssm --extra --data.init_args.train_subset=6400

Each variant is ``train.py fit`` on one of ``configs/nice/*.yaml`` (run directory ``<runs-root>/<variant>``)
followed by ``train.py test`` on its last checkpoint. The table (``nice_study.md`` / ``.json`` under ``--out``)
holds, per variant: parameters, activation memory of one training step, seconds per training step, and the
test log-likelihood (logit space), bits/dim and exact SM. The paper trains 100 epochs; this study shows the
framework end to end at a budget a CPU affords, so compare rows with each other, not with the paper.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..lightning.callbacks import read_metrics_csv
from .measure import environment

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Variant:
    config: str  # relative to the repository root
    overrides: tuple[str, ...] = ()


VARIANTS = {
    "explicit_ssm": Variant("configs/nice/explicit.yaml", ("--model.init_args.loss=ssm",)),
    "deq_ssm": Variant("configs/nice/deq.yaml", ("--model.init_args.loss=ssm",)),
    "deq_reference_ssm": Variant("configs/nice/deq_reference.yaml", ("--model.init_args.loss=ssm",)),
    "explicit_dsm": Variant("configs/nice/explicit.yaml", ("--model.init_args.loss=dsm", "--optimizer.lr=1e-3")),
    "deq_dsm": Variant("configs/nice/deq.yaml", ("--model.init_args.loss=dsm", "--optimizer.lr=1e-3")),
}
DEFAULT_VARIANTS = ("explicit_ssm", "deq_ssm")
# exact SM takes D = 784 batched backward passes; 32 samples of the first batch keep it to seconds per validation
COMMON = ("--model.init_args.exact_sm_samples=32",)
TEST_KEYS = ("test/log_likelihood", "test/bits_per_dim", "test/exact_sm", "test/loss")


def run_variant(name: str, epochs: int, runs_root: Path, extra: list[str]) -> dict:
    """Fit then test one variant; return its row."""
    from ..cli.train import main

    # the runs are CLI calls made from Python while this script has its own argv
    warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")
    variant = VARIANTS[name]
    common = [f"--run_name={name}", f"--runs_root={runs_root}", *COMMON, *variant.overrides, *extra]
    start = time.perf_counter()
    fit = main(["fit", f"--config={ROOT / variant.config}", f"--trainer.max_epochs={epochs}", *common])
    fit_seconds = time.perf_counter() - start
    run_dir = runs_root / name
    test = main(["test", f"--config={run_dir / 'config.yaml'}",
                 f"--ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"])
    series = read_metrics_csv(run_dir / "metrics.csv")
    steps = fit.trainer.global_step
    row = {
        "variant": name,
        "config": variant.config,
        "overrides": " ".join([*variant.overrides, *extra]),
        "epochs": epochs,
        "steps": steps,
        "parameters": int(series["run/parameters"][-1][1]),
        "activation_memory_mb": series["run/activation_memory_mb"][-1][1],
        "seconds_per_step": fit_seconds / max(steps, 1),  # includes validation and checkpointing
    }
    row.update({key.split("/")[1]: float(test.trainer.callback_metrics[key]) for key in TEST_KEYS})
    return row


def to_markdown(rows: list[dict], env: dict) -> str:
    lines = ["# NICE study (reduced budget)", ""]
    lines += [f"* **{k}**: {v}" for k, v in env.items()]
    lines += ["", "| variant | epochs (steps) | parameters | activation memory (MiB) | s / step | test log-lik. "
              "(nats, logit) | test bits/dim | test exact SM | test loss |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['epochs']} ({r['steps']}) | {r['parameters']:,} | {r['activation_memory_mb']:.1f} "
            f"| {r['seconds_per_step']:.3f} | {r['log_likelihood']:.1f} | {r['bits_per_dim']:.3f} | "
            f"{r['exact_sm']:.1f} | {r['loss']:.1f} |"
        )
    lines += ["", "* s / step: wall clock of `fit` divided by its steps (validation and checkpointing included).",
              "* test exact SM: through a cold unroll of the solver (the converged model's exact SM), on the "
              "configured number of test batches/samples; bits/dim as logged (approximate for the `logit` clamp)."]
    lines += [f"* {r['variant']}: `{r['config']}` {r['overrides']}".rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def chosen_variants(parser: argparse.ArgumentParser, text: str, known: dict) -> list[str]:
    """The comma-separated variant names of ``text``; an unknown one is a parser error listing ``known``."""
    names = [v for v in text.split(",") if v]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(known)}")
    return names


def write_study(out: str | Path, stem: str, rows: list[dict], env: dict, markdown: str) -> None:
    """``<out>/<stem>.json`` (environment and rows) and ``<out>/<stem>.md``; the markdown is also printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"from {sorted(VARIANTS)}")
    parser.add_argument("--runs-root", default="checkpoints/study")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="arguments passed to every run")
    args = parser.parse_args(argv)
    names = chosen_variants(parser, args.variants, VARIANTS)
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))  # before the load we add
    rows = [run_variant(name, args.epochs, Path(args.runs_root), args.extra) for name in names]
    write_study(args.out, "nice_study", rows, env, to_markdown(rows, env))
    return rows


if __name__ == "__main__":
    main()
