"""Section ``dkef``: the DKEFs of ``configs/dkef/{explicit_shallow,explicit_deep,deq}.yaml`` on RedWine and on the
synthetic ``highdim`` Gaussian, each trained for the same short budget as training trains it: a Lightning Trainer
fits :class:`deqscore.lightning.DKEFModule` (its two-stage step, the stored alpha solved afresh at each validation,
the config's optimiser and gradient clipping), then tests it. Per row: parameters, activation memory of one training
step (forward and backward, :func:`deqscore.metrics.step_activation_bytes`), the median time of the steps after the
first, and the module's own test metrics (log-likelihood with its log Z standard error; on highdim the Fisher
divergence to N(0, I) and the true log-likelihood).
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import instantiate_class

from deqscore.data import UCIDataModule
from deqscore.data.errors import DataNotFoundError
from deqscore.deq import DEQ
from deqscore.lightning import DKEFModule
from deqscore.metrics import parameter_count

from ..configs import ROOT, Options, Variant, attach_optimizer, build, options_text, read_config, set_option
from ..measure import MIB, log, loss_step_bytes, sync
from ..report import Column, Table, fmt_value
from ..settings import Settings
from ..study.core import Variant as StudyVariant
from ..study.evaluation import test_metrics

VARIANTS = (
    Variant("explicit shallow", "configs/dkef/explicit_shallow.yaml"),
    Variant("explicit deep", "configs/dkef/explicit_deep.yaml"),
    Variant("DEQ", "configs/dkef/deq.yaml"),
)
RATIO_KEYS = ("params", "act_mib", "time_ms")
MEMORY_SEED = 0  # the draws (projections) of the step whose memory is measured
DATA_ROOT = "datasets/uci"  # folder of the shipped UCI files, relative to the repository root
# Options of every row: the budget is the fixed number of steps, so log_lambda is not fine-tuned after it, and exact
# SM (D backward passes per test batch) is not reported.
COMMON: Options = {"final_lambda_steps": 0, "exact_sm_batches": 0}


@dataclass(frozen=True)
class DKEFRun:
    """One mode's budget: data, training steps and the model options stated for it (none restate a config)."""

    dims: tuple[int, ...]  # dimensions of the synthetic highdim N(0, I) data
    steps: int  # training steps of every net (the first is the warm-up, not timed)
    steps_by_dim: tuple[tuple[int, int], ...] = ()  # (dim, steps) overriding ``steps``
    redwine: bool = True  # RedWine rows (skipped with a note when its file is not in DATA_ROOT)
    batch: int | None = None  # training batch (None: the config's)
    options: Options = field(default_factory=dict)  # model options of every row
    highdim_options: Options = field(default_factory=dict)  # ... of the highdim rows


RUNS = {
    # log Z from 10^5 importance samples on highdim (10 s per model at D = 800), the config's 10^6 on RedWine
    "full": DKEFRun(dims=(50, 200, 800), steps=100, steps_by_dim=((800, 40),),
                    highdim_options={"final_log_z_samples": 100_000}),
    "quick": DKEFRun(dims=(8, 16), steps=5, batch=40,
                     options={"net.n_centres": 10, "net.hidden": 8, "alpha_points": 100, "final_log_z_samples": 2000,
                              "log_z_chunk": 1000}),
}


# ---------------------------------------------------------------- building blocks (also used by the tests)


def data_root() -> Path:
    return (ROOT / DATA_ROOT).resolve()


def steps_for(run: DKEFRun, dim: int) -> int:
    """Training steps at data dimension ``dim``."""
    return dict(run.steps_by_dim).get(dim, run.steps)


def datamodule(variant: Variant, run: DKEFRun, dataset: str, dim: int | None = None) -> UCIDataModule:
    """The config's data module on ``dataset`` (``dim``: of highdim), set up; DataNotFoundError without its file."""
    spec = copy.deepcopy(read_config(variant.config)["data"])
    overrides: dict[str, object] = {"root": str(data_root()), "dataset": dataset}
    overrides |= ({"dim": dim} if dim else {}) | ({"batch_size": run.batch} if run.batch else {})
    for key, value in overrides.items():
        set_option(spec, key, value)
    dm = cast(UCIDataModule, instantiate_class((), spec))
    dm.setup("fit")
    return dm


def options(run: DKEFRun, dm: UCIDataModule, **extra: object) -> dict[str, object]:
    """The options a row is built with: the data's dimension, the common and the mode's options, then ``extra``."""
    data = run.highdim_options if dm.is_synthetic else {}
    return {"net.dim": dm.dim, **COMMON, **run.options, **data, **extra}


def build_dkef(variant: Variant, run: DKEFRun, dm: UCIDataModule, **extra: object) -> DKEFModule:
    """The module of ``variant``'s config for the data of ``dm``, its centres drawn as ``DKEFModule.setup`` does."""
    module = cast(DKEFModule, build(variant.config, options(run, dm, **extra)))
    module.net.init_centres(dm.train_data, torch.Generator().manual_seed(0))
    return module


def memory_batch(dm: UCIDataModule) -> torch.Tensor:
    """The training batch whose step's memory is measured: the first rows of the training split, in a storage of
    their own as the data loader gives them (the meter counts whole storages: a view would count the split)."""
    return dm.train_data[: dm.batch_size].clone()


def step_memory(module: DKEFModule, x: torch.Tensor) -> int:
    """Activation memory (bytes) of one training step of ``module`` (train mode) on ``x``, draws from MEMORY_SEED."""
    with torch.random.fork_rng():
        torch.manual_seed(MEMORY_SEED)
        return loss_step_bytes(module, lambda: module.loss_terms(x)["loss"])


# ---------------------------------------------------------------- one row


class StepProbe(pl.Callback):
    """The memory of one step before training; per training step its time, loss and DEQ solver iterations.

    A step's time spans ``training_step`` (whose own alpha is solved from the batch), backward, clipping and the
    optimiser step; the stored alpha is solved afresh only at validation (``DKEFModule.on_validation_epoch_start``).
    """

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.memory = 0
        self.times: list[float] = []
        self.losses: list[float] = []
        self.iterations: list[int] = []
        self._start, self._active, self._hooks = 0.0, False, []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.memory = step_memory(cast(DKEFModule, module.train()), self.x.to(module.device))
        self._hooks = [m.register_forward_hook(self._count) for m in module.modules() if isinstance(m, DEQ)]

    def _count(self, layer: DEQ, args: object, out: object) -> None:
        if self._active:
            self.iterations.append(layer.stats.nstep)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
        sync(module.device)
        self._active, self._start = True, time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        sync(module.device)
        self.times.append(time.perf_counter() - self._start)
        self._active = False
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for hook in self._hooks:
            hook.remove()


def _trainer(variant: Variant, steps: int, device: torch.device, probe: StepProbe) -> pl.Trainer:
    """A Trainer with the config's gradient clipping, for ``steps`` steps, without validation, logs or files."""
    spec = read_config(variant.config)["trainer"]
    return pl.Trainer(
        accelerator=device.type, devices=1, max_steps=steps, max_epochs=-1, inference_mode=False,
        gradient_clip_val=spec.get("gradient_clip_val"), limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )


@contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's per-run banners (accelerators, tips, the resolved loss) and its advice on loader workers, off:
    the benchmark fits many short runs."""
    logger = logging.getLogger("pytorch_lightning")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
            yield
    finally:
        logger.setLevel(level)


def fit_and_test(variant: Variant, run: DKEFRun, dm: UCIDataModule, device: torch.device,
                 ) -> tuple[dict, DKEFModule]:
    """Train the variant's module for the run's budget and test it; its row and the trained module."""
    module = build_dkef(variant, run, dm)
    attach_optimizer(module, variant.config)
    probe = StepProbe(memory_batch(dm))
    trainer = _trainer(variant, steps_for(run, dm.dim), device, probe)
    with _quiet():
        trainer.fit(module, datamodule=dm)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = trainer.test(module, datamodule=dm, verbose=False)[0]
    times, tail = probe.times[1:], probe.losses[-max(1, len(probe.losses) // 10):]
    row = {
        "model": variant.label, "config": variant.config, "params": parameter_count(module),
        "act_mib": probe.memory / MIB, "steps": len(probe.times),
        "time_ms": 1e3 * statistics.median(times) if times else None, "repeats": len(times),
        "solver_iters": statistics.mean(probe.iterations) if probe.iterations else None,
        "first_loss": probe.losses[0], "final_loss": statistics.mean(tail),
        "log_z_warning": any("log_partition" in str(w.message) for w in caught),
    }
    return row | _test_metrics(metrics, module.final_log_z_samples), module


def _test_metrics(metrics: dict[str, float], n: int) -> dict:
    """The module's test metrics as row cells; the importance sampler's effective sample size from its stderr."""
    stderr = float(metrics["test/log_z_stderr"])
    row = {"test_ll": float(metrics["test/log_likelihood"]), "log_z": float(metrics["test/log_z"]),
           "log_z_stderr": stderr, "ess": n / (1 + stderr**2 * (n - 1)), "test_loss": float(metrics["test/loss"])}
    if "test/fisher_divergence" in metrics:
        row |= {"fisher": float(metrics["test/fisher_divergence"]),
                "true_ll": float(metrics["test/true_log_likelihood"])}
    return row


def _baselines(module: DKEFModule, dm: UCIDataModule) -> dict:
    """What the kernel part has to improve on: the base q0 = N(0, q0_std^2 I) alone, normalised exactly; and the
    median kernel value on the test points."""
    net, test = module.net.cpu(), dm.test_data
    var = net.q0_std**2
    sq_norm = test.pow(2).sum(1).mean().item()
    with torch.no_grad():
        kernel = net.kernel(test).median().item()
    row = {"base_ll": -0.5 * dm.dim * math.log(2 * math.pi * var) - sq_norm / (2 * var), "kernel_median": kernel}
    if dm.is_synthetic:
        row["base_fisher"] = 0.5 * (1 - 1 / var) ** 2 * sq_norm  # q0 alone: score -x / var
    return row


def dkef_row(variant: Variant, run: DKEFRun, dm: UCIDataModule, name: str, device: torch.device) -> dict:
    row, module = fit_and_test(variant, run, dm, device)
    row = {"data": name, "dim": dm.dim, **row, **_baselines(module, dm)}
    log(f"dkef: {name} D={dm.dim} {variant.label}: {row['act_mib']:.1f} MiB, "
        f"{fmt_value(row['time_ms'], '.0f')} ms/step, loss {row['first_loss']:.3g} -> {row['final_loss']:.3g}, "
        f"test LL {row['test_ll']:.3f} (log Z stderr {row['log_z_stderr']:.2g}, ESS {row['ess']:.0f})")
    return row


def ratios(rows: dict[str, dict]) -> dict[str, float | None]:
    """DEQ row / explicit deep row for parameters, activation memory and step time."""
    deq, deep = rows["DEQ"], rows["explicit deep"]
    return {k: deq[k] / deep[k] if deq[k] and deep[k] else None for k in RATIO_KEYS}


def _ratio_row(rows: dict[str, dict], ratio: dict[str, float | None]) -> dict:
    """The ratios as a table row (text cells: the columns' number formats are those of the rows above)."""
    cells = {k: None if v is None else f"{v:.3f}x" for k, v in ratio.items()}
    return {"data": rows["DEQ"]["data"], "dim": rows["DEQ"]["dim"], "model": "ratio DEQ / explicit deep", **cells}


# ---------------------------------------------------------------- the section


def _datasets(run: DKEFRun) -> tuple[list[tuple[str, int | None]], list[str]]:
    """(data set, highdim dimension) of every group of rows, and notes on what was skipped."""
    groups: list[tuple[str, int | None]] = []
    notes: list[str] = []
    if run.redwine:
        try:
            datamodule(VARIANTS[0], run, "redwine")
            groups.append(("redwine", None))
        except DataNotFoundError:
            notes.append(f"RedWine skipped: winequality-red.csv is not in {data_root()}.")
            log(f"dkef: RedWine skipped (no winequality-red.csv in {data_root()})")
    return groups + [("highdim", d) for d in run.dims], notes


def _default_init_kernel(run: DKEFRun, dm: UCIDataModule) -> float:
    """Median kernel value on the test points at the fixed widths ``10^l`` (before any training)."""
    module = build_dkef(VARIANTS[0], run, dm, **{"net.bandwidth_init": "fixed"})
    with torch.no_grad():
        return module.net.kernel(dm.test_data).median().item()


def section(s: Settings, device: torch.device) -> Table:
    table = Table("dkef", "5. DKEF feature networks: explicit shallow, explicit deep, DEQ (two-stage SSM-VR)", [
        Column("data", "data"), Column("dim", "D"), Column("model", "feature net"), Column("params", "parameters", ","),
        Column("act_mib", "activation memory (MiB)", ".2f"), Column("time_ms", "step time (ms)", ".0f"),
        Column("steps", "steps"), Column("solver_iters", "Picard iters / solve", ".1f"),
        Column("first_loss", "loss step 1", ".4g"), Column("final_loss", "loss, last 10%", ".4g"),
        Column("test_ll", "test log-lik.", ".3f"), Column("log_z_stderr", "log Z stderr", ".2g"),
        Column("ess", "IS ESS", ".0f"), Column("true_ll", "true test log-lik.", ".3f"),
        Column("fisher", "Fisher div.", ".4g"), Column("kernel_median", "median k (test)", ".2g"),
    ])
    run = RUNS[s.mode]
    groups, skipped = _datasets(run)
    default_kernel, table.meta["ratios_deq_over_deep"] = {}, {}
    for dataset, dim in groups:
        name = "RedWine" if dataset == "redwine" else dataset
        rows = {}
        for variant in VARIANTS:
            dm = datamodule(variant, run, dataset, dim)
            rows[variant.label] = dkef_row(variant, run, dm, name, device)
        key = f"{name} {dm.dim}"
        table.meta["ratios_deq_over_deep"][key] = ratio = ratios(rows)
        table.rows += [*rows.values(), _ratio_row(rows, ratio)]
        default_kernel[key] = _default_init_kernel(run, dm)
    table.meta["median_kernel_at_default_init"] = default_kernel
    table.meta["run"] = {"steps": run.steps, "steps_by_dim": run.steps_by_dim, "batch": run.batch,
                         "options": {**COMMON, **run.options}, "highdim_options": dict(run.highdim_options)}
    table.notes += skipped + _notes(run, table.rows, default_kernel) + findings(table.rows)
    return table


def _groups(rows: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    out: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        if not r["model"].startswith("ratio"):
            out.setdefault((r["data"], r["dim"]), {})[r["model"]] = r
    return out


def _growth(groups: dict[tuple[str, int], dict[str, dict]]) -> str:
    """How memory and time of each net grow over the highdim dimensions."""
    dims = sorted(d for name, d in groups if name == "highdim")
    if len(dims) < 2:
        return ""
    lo, hi = groups["highdim", dims[0]], groups["highdim", dims[-1]]
    parts = [f"{m} x{hi[m]['act_mib'] / lo[m]['act_mib']:.1f} memory, x{hi[m]['time_ms'] / lo[m]['time_ms']:.1f} time"
             for m in lo]
    return f"Growth with D (highdim, D = {dims[0]} -> {dims[-1]}, x{dims[-1] / dims[0]:g}): " + "; ".join(parts) + "."


def _quality(key: tuple[str, int], g: dict[str, dict]) -> str:
    deq, deep, sh = g["DEQ"], g["explicit deep"], g["explicit shallow"]
    diff = deq["test_ll"] - deep["test_ll"]
    se = math.hypot(deq["log_z_stderr"], deep["log_z_stderr"])
    text = (f"{key[0]} D={key[1]}: test log-lik. DEQ {deq['test_ll']:.2f}, deep {deep['test_ll']:.2f}, shallow "
            f"{sh['test_ll']:.2f}, the base q0 alone {deq['base_ll']:.2f} (exact); DEQ - deep = {diff:+.2f} nats "
            f"({abs(diff) / max(se, 1e-12):.1f} combined log Z stderrs)")
    if min(r["ess"] for r in g.values()) < 100:
        text += ", but with IS ESS < 100 the log Z, hence this comparison, is not reliable"
    if deq.get("fisher") is not None:
        text += (f"; Fisher div. DEQ {deq['fisher']:.4g}, deep {deep['fisher']:.4g}, shallow {sh['fisher']:.4g}, "
                 f"q0 alone {deq['base_fisher']:.4g} (true test log-lik. {deq['true_ll']:.2f})")
    return text + "."


def _memory_trend(groups: dict[tuple[str, int], dict[str, dict]]) -> str:
    """Whether, over the highdim dimensions, the DEQ's saving stays put while its ratio to the deep net rises."""
    high = [g for (name, _), g in sorted(groups.items(), key=lambda kv: kv[0][1]) if name == "highdim"]
    if len(high) < 2:
        return ""
    saving = [g["explicit deep"]["act_mib"] - g["DEQ"]["act_mib"] for g in high]
    ratio = [g["DEQ"]["act_mib"] / g["explicit deep"]["act_mib"] for g in high]
    flat = max(saving) <= 1.2 * min(saving)
    rising = all(a < b for a, b in zip(ratio, ratio[1:], strict=False))
    text = (f" On highdim the saving {'stays within 20%' if flat else 'varies by more than 20%'} over D "
            f"({min(saving):.1f}-{max(saving):.1f} MiB), and the DEQ / deep memory ratio "
            f"{'rises' if rising else 'does not rise steadily'} with D")
    if flat and rising:
        text += (": the saving is the deep net's extra layers, while the kernel algebra (the [D, B, M] "
                 "kernel-derivative tensors, the same for every feature net) grows with D, so the feature net's share "
                 "of the step shrinks")
    return text + "."


def findings(rows: list[dict]) -> list[str]:
    """What the rows show, stated from the numbers (so that the text cannot drift from the table)."""
    groups = _groups(rows)
    if not groups:
        return []
    mem = "; ".join(f"{n} D={d}: {g['DEQ']['act_mib']:.1f} vs {g['explicit deep']['act_mib']:.1f} MiB "
                    f"(saves {g['explicit deep']['act_mib'] - g['DEQ']['act_mib']:.1f}; shallow "
                    f"{g['explicit shallow']['act_mib']:.1f})" for (n, d), g in groups.items())
    ratio_mem = ", ".join(f"{g['DEQ']['act_mib'] / g['explicit deep']['act_mib']:.2f}" for g in groups.values())
    ratio_time = ", ".join(f"{g['DEQ']['time_ms'] / g['explicit deep']['time_ms']:.2f}" for g in groups.values())
    lines = [f"Findings, activation memory DEQ vs explicit deep: {mem}. DEQ / deep ratios in table order: memory "
             f"{ratio_mem}; step time {ratio_time}." + _memory_trend(groups)]
    growth = _growth(groups)
    if growth:
        lines.append(growth)
    lines.append("Findings, quality after the fixed budget: " + " ".join(_quality(k, g) for k, g in groups.items()))
    better_fisher = [f"D={d}" for (n, d), g in groups.items()
                     if g["DEQ"].get("fisher") is not None and g["DEQ"]["fisher"] <= g["explicit deep"]["fisher"]]
    fisher_rows = sum(g["DEQ"].get("fisher") is not None for g in groups.values())
    if fisher_rows:
        lines.append(f"On highdim the DEQ's Fisher divergence (no log Z involved) is at most the deep net's at "
                     f"{len(better_fisher)} of {fisher_rows} dimensions ({', '.join(better_fisher) or 'none'}).")
    lines.append("These are models after a short, equal budget, not converged ones: the table compares costs and "
                 "early training, not the final log-likelihoods of fully trained DKEFs.")
    return lines


def _notes(run: DKEFRun, rows: list[dict], default_kernel: dict[str, float]) -> list[str]:
    steps = f"{run.steps} steps" + "".join(f" ({n} at D = {d})" for d, n in run.steps_by_dim)
    init = ", ".join(f"{k}: {v:.1e}" for k, v in default_kernel.items())
    unreliable = [f"{r['data']} {r['dim']} {r['model']}" for r in rows if r.get("log_z_warning")]
    highdim = f"; on highdim also {options_text(run.highdim_options)}" if run.highdim_options else ""
    return [
        "Each DKEF is its config's module (`build_module` on `model:`; " + ", ".join(v.config for v in VARIANTS)
        + f"), with the options {options_text({**COMMON, **run.options})}{highdim}, and the config's data module "
        f"(batch {run.batch or 'of the config'}). A Lightning Trainer fits it for {steps} with the config's optimiser "
        "and gradient clipping, no validation: the step is `DKEFModule.training_step` (alpha solved on the first "
        "half of the batch with create_graph=True, the loss on the second half), as in training; the same "
        "batches, projections and seed for the three nets. The test metrics are the "
        "module's own (`trainer.test`): log Z by importance sampling with final_log_z_samples draws, test "
        "log-lik. = mean over the test split, on highdim the Fisher divergence to N(0, I) (score through the "
        "unrolled solve) and the true log-lik. of N(0, I) on the same points; IS ESS = effective sample size, "
        "from the stderr.",
        "Activation memory: `loss_step_bytes` of one training step (forward and backward, parameters "
        "excluded) on the first rows of the training split before training: the figure training logs as "
        "run/activation_memory_mb. Step time: median wall clock of the steps after the first (training_step, "
        "backward, clipping and the optimiser step); Picard iters: mean solver iterations per DEQ forward in them.",
        "The log Z stderr only measures the spread of the weights among the draws: in high dimension the proposal "
        "can miss the mass of the model altogether, so a small stderr does not prove an accurate log Z. Estimates "
        "flagged unreliable by `log_partition` (ESS < 100 or stderr > 0.1): "
        + ("; ".join(unreliable) if unreliable else "none") + ".",
        "Kernel widths from the data (the configs' `bandwidth_init: median`: l_j shifted by log10(median squared "
        "feature distance / 2) between training points and centres). Median k on the test points at the fixed "
        f"widths (`bandwidth_init: fixed`), shallow net: {init}; a k near 0 means kernels that vanish (no gradient "
        "reaches the features), so that DKEF stays at its base q0: the reason for the median init.",
    ]


def evaluate(run_dir: Path, checkpoint: Path, variant: StudyVariant, seed: int, evaluation: dict) -> dict:
    """The study's evaluation of a trained DKEF run (see :mod:`deqlab.study.evaluation`)."""
    options = [f"--model.init_args.final_log_z_samples={evaluation['log_z_samples']}",
               f"--model.init_args.log_z_proposal={evaluation['log_z_proposal']}"]
    metrics = test_metrics(run_dir, checkpoint, options,
                           ("log_likelihood", "log_z", "log_z_stderr", "log_z_ess", "exact_sm", "loss"))
    return metrics | {"log_z_estimator": f"importance sampling, {evaluation['log_z_proposal']} proposal, "
                                         f"{evaluation['log_z_samples']:,} draws"}
