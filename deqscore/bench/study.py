"""A reduced-budget NICE study: train explicit and DEQ NICE with the same loss and budget over several seeds, then
test each run.

Run::

    python -m deqscore.bench.study                          # 2 epochs per variant and seed at the paper's sizes
    python -m deqscore.bench.study --seeds 0,1,2 --epochs 1 --variants explicit_ssm,deq_ssm

Each (variant, seed) is ``train.py fit`` on one of ``configs/nice/*.yaml`` with ``seed_everything`` set to the
seed (run directory ``<runs-root>/<variant>_s<seed>``) followed by ``train.py test`` on its last checkpoint, and is
recorded as one JSON file under ``<out>/study/nice/`` (family, variant, seed, device, budget and the row). A
recorded unit with the same budget is read back instead of run again, so an interrupted study continues where it
stopped (a run directory left by an interrupted unit is moved aside). The table (``nice_study.md`` / ``.json``
under ``--out``) holds, per run: parameters, activation memory of one training step, seconds per training step,
and the test log-likelihood (logit space), bits/dim and exact SM; and per variant the mean and standard error over
the seeds. The paper trains 100 epochs; this study shows the framework end to end at a budget a CPU affords, so
compare rows with each other, not with the paper.
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
from .units import mean_stderr, recorded

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Variant:
    config: str  # relative to the repository root
    overrides: tuple[str, ...] = ()


VARIANTS = {
    "explicit_ssm": Variant("configs/nice/explicit.yaml", ("--model.init_args.loss=ssm",)),
    "explicit_deep_ssm": Variant("configs/nice/explicit_deep.yaml", ("--model.init_args.loss=ssm",)),
    "deq_ssm": Variant("configs/nice/deq.yaml", ("--model.init_args.loss=ssm",)),
    "deq_reference_ssm": Variant("configs/nice/deq_reference.yaml", ("--model.init_args.loss=ssm",)),
    "explicit_dsm": Variant("configs/nice/explicit.yaml", ("--model.init_args.loss=dsm", "--optimizer.lr=1e-3")),
    "deq_dsm": Variant("configs/nice/deq.yaml", ("--model.init_args.loss=dsm", "--optimizer.lr=1e-3")),
}
DEFAULT_VARIANTS = ("explicit_ssm", "deq_ssm")
# exact SM takes D = 784 batched backward passes; 32 samples of the first batch keep it to seconds per validation
COMMON = ("--model.init_args.exact_sm_samples=32",)
TEST_KEYS = ("test/log_likelihood", "test/bits_per_dim", "test/exact_sm", "test/loss")


def run_variant(name: str, epochs: int, runs_root: Path, extra: list[str], seed: int = 0) -> dict:
    """Fit then test one variant at one seed; return its row."""
    from ..cli.train import main
    from ..lightning.runs import move_aside

    # the runs are CLI calls made from Python while this script has its own argv
    warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")
    variant = VARIANTS[name]
    run_dir = runs_root / f"{name}_s{seed}"
    if run_dir.exists():  # left by an interrupted unit: kept aside, never written into
        print(f"moved the unfinished run {run_dir} to {move_aside(run_dir)}")
    common = [f"--run_name={run_dir.name}", f"--runs_root={runs_root}", f"--seed_everything={seed}", *COMMON,
              *variant.overrides, *extra]
    start = time.perf_counter()
    fit = main(["fit", f"--config={ROOT / variant.config}", f"--trainer.max_epochs={epochs}", *common])
    fit_seconds = time.perf_counter() - start
    test = main(["test", f"--config={run_dir / 'config.yaml'}",
                 f"--ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"])
    series = read_metrics_csv(run_dir / "metrics.csv")
    steps = fit.trainer.global_step
    row = {
        "variant": name,
        "seed": seed,
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


def run_unit(name: str, seed: int, epochs: int, runs_root: Path, extra: list[str], out: Path, device: str) -> dict:
    """The row of (``name``, ``seed``): read back from its unit file when recorded with the same budget, else run
    and recorded (:func:`deqscore.bench.units.recorded`)."""
    unit = out / "study" / "nice" / f"{name}_s{seed}.json"
    budget = {"epochs": epochs, "extra": list(extra)}
    return recorded(unit, budget, lambda: run_variant(name, epochs, runs_root, extra, seed),
                    family="nice", variant=name, seed=seed, device=device)


def summarise(rows: list[dict]) -> list[dict]:
    """Per variant: the seeds, and the mean and standard error over them (None for one seed) of every metric."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        runs = [r for r in rows if r["variant"] == name]
        summary = {"variant": name, "seeds": [r["seed"] for r in runs]}
        for key in (*(k.split("/")[1] for k in TEST_KEYS), "activation_memory_mb", "seconds_per_step"):
            mean, stderr = mean_stderr([r[key] for r in runs])
            summary[key] = {"mean": mean, "stderr": stderr}
        out.append(summary)
    return out


def to_markdown(rows: list[dict], env: dict) -> str:
    lines = ["# NICE study (reduced budget)", ""]
    lines += [f"* **{k}**: {v}" for k, v in env.items()]
    lines += ["", "| variant | seed | epochs (steps) | parameters | activation memory (MiB) | s / step | test "
              "log-lik. (nats, logit) | test bits/dim | test exact SM | test loss |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['seed']} | {r['epochs']} ({r['steps']}) | {r['parameters']:,} | "
            f"{r['activation_memory_mb']:.1f} | {r['seconds_per_step']:.3f} | {r['log_likelihood']:.1f} | "
            f"{r['bits_per_dim']:.3f} | {r['exact_sm']:.1f} | {r['loss']:.1f} |"
        )
    lines += ["", "Mean ± standard error over the seeds (None with one seed):", "",
              "| variant | seeds | test log-lik. | test bits/dim | test exact SM |", "|---|---|---|---|---|"]
    for s in summarise(rows):
        cells = [f"{s[k]['mean']:.3f} ± {s[k]['stderr'] if s[k]['stderr'] is None else format(s[k]['stderr'], '.3f')}"
                 for k in ("log_likelihood", "bits_per_dim", "exact_sm")]
        lines.append(f"| {s['variant']} | {', '.join(map(str, s['seeds']))} | {' | '.join(cells)} |")
    lines += ["", "* s / step: wall clock of `fit` divided by its steps (validation and checkpointing included).",
              "* test exact SM: through a cold unroll of the solver (the converged model's exact SM), on the "
              "configured number of test batches/samples; bits/dim as logged (approximate for the `logit` clamp)."]
    lines += [f"* {r['variant']}: `{r['config']}` {r['overrides']}".rstrip()
              for r in {r["variant"]: r for r in rows}.values()]
    return "\n".join(lines) + "\n"


def chosen_variants(parser: argparse.ArgumentParser, text: str, known: dict) -> list[str]:
    """The comma-separated variant names of ``text``; an unknown one is a parser error listing ``known``."""
    names = [v for v in text.split(",") if v]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(known)}")
    return names


def write_study(out: str | Path, stem: str, rows: list[dict], env: dict, markdown: str,
                summary: list[dict] | None = None) -> None:
    """``<out>/<stem>.json`` (environment, rows and, when given, the per-variant summary) and ``<out>/<stem>.md``;
    the markdown is also printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"environment": env, "rows": rows, **({"summary": summary} if summary is not None else {})}
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (seed_everything of each run)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"from {sorted(VARIANTS)}")
    parser.add_argument("--runs-root", default="checkpoints/study")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="arguments passed to every run")
    args = parser.parse_args(argv)
    names = chosen_variants(parser, args.variants, VARIANTS)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))  # before the load we add
    rows = [run_unit(name, seed, args.epochs, Path(args.runs_root), args.extra, Path(args.out), env["device"])
            for name in names for seed in seeds]
    write_study(args.out, "nice_study", rows, env, to_markdown(rows, env), summarise(rows))
    return rows


if __name__ == "__main__":
    main()
