"""``python -m deqlab sync``: host synchronisations and step time of training steps, default vs sync-free,
and the accuracy cost of bfloat16 mixed precision through a DEQ.

A host sync is a point where Python waits for the device: ``Tensor.item``, ``tolist``, ``__bool__``,
``__float__``, ``__int__`` and ``.cpu()``. :class:`HostSyncCounter` wraps these and files each call under the
package of the frame that made it: ``deqscore`` (the project's own code), ``lightning`` (PyTorch Lightning) or
``other``; calls from ``deqscore/data/`` (the loader's CPU tensors, never a device wait) are filed as ``data``.
On a CPU they cost nothing, but their number per step is the number of times a GPU step would stall.
Syncs made inside C++ (a boolean mask index, ``nonzero``) are not seen by this count.

Rows (``benchmarks/results/sync/sync.{md,json}``, the device named):

* per family (NICE, NCSN with DEQ layers, through the real CLI at small sizes): host syncs per training step,
  deqscore's and Lightning's apart, and the median step time, in the default configuration and the fast one
  (``SyncFreeSteps`` callback, DEQ ``check_every: 0`` with a fixed ``max_iter``);
* bf16 fidelity: the phantom gradient of a DEQ-NICE SSM loss under bf16 autocast against float32 (cosine,
  relative error), and a short NICE run (loss curve ends, validation bits/dim) in bf16-mixed and 32-bit.

bfloat16 matmuls are emulated and slow on most CPUs: the bf16 rows here measure accuracy only; bf16 speed is a
GPU figure.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

import deqscore
from deqscore.families import ROOT

from .measure import environment
from .report import Column, Result, ResultFormatError, Table, read_result, section_rows, write_result

RESULTS = ROOT / "benchmarks" / "results" / "sync"
_PACKAGE = str(Path(deqscore.__file__).resolve().parent)  # the library's own calls count as "deqscore"
_DATA = str(Path(deqscore.__file__).resolve().parent / "data")
TITLE = "Host syncs per training step and bf16 fidelity (`python -m deqlab sync`)"
SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")


def _origin(filename: str) -> str:
    if filename.startswith(_DATA):  # the data pipeline works on the loader's CPU tensors: no device waits
        return "data"
    if filename.startswith(_PACKAGE):
        return "deqscore"
    if "pytorch_lightning" in filename or "lightning_fabric" in filename or "/lightning/" in filename:
        return "lightning"
    return "other"


class HostSyncCounter:
    """Counts host-sync calls by the package of the calling frame, while active (a context manager).

    ``calls`` counts ``(origin, method, "file:line")``; :meth:`mark` closes a window (one training step, by
    :class:`StepWindows`) and :attr:`windows` keeps each window's counts by origin.
    """

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str, str]] = Counter()
        self.windows: list[Counter[str]] = []
        self._window: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            origin = _origin(frame.f_code.co_filename)
            # a CPU tensor copied to the CPU (a no-op) is no sync; every other call waits for the device
            if not (name == "cpu" and tensor.device.type == "cpu"):
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                counter.calls[(origin, name, where)] += 1
                counter._window[origin] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def __enter__(self) -> HostSyncCounter:
        for name in SYNC_METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def mark(self) -> None:
        self.windows.append(self._window)
        self._window = Counter()

    def by_origin(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for (origin, _, _), n in self.calls.items():
            total[origin] += n
        return total

    def sites(self, origin: str) -> dict[str, int]:
        """``"method file:line" -> count`` of the calls from ``origin``."""
        return {f"{m} {w}": n for (o, m, w), n in sorted(self.calls.items()) if o == origin}


class StepWindows(pl.Callback):
    """Closes a :class:`HostSyncCounter` window at every training batch start and records the step times: window
    ``k`` holds everything from batch ``k - 1``'s start to batch ``k``'s (Lightning's logging included)."""

    def __init__(self, counter: HostSyncCounter):
        self.counter = counter
        self.times: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.counter.mark()
        self.times.append(time.perf_counter())


def per_step(counter: HostSyncCounter, times: list[float], skip: int = 1) -> dict[str, Any]:
    """Sync counts and times of the whole steps (windows between two batch starts), the first ``skip`` left out
    (the first step measures the run's facts)."""
    windows = counter.windows[1 + skip:]
    steps = [b - a for a, b in zip(times[skip:], times[skip + 1:], strict=False)]
    return {
        "steps": len(windows),
        "deqscore_syncs_max": max((w["deqscore"] for w in windows), default=0),
        "deqscore_syncs_mean": statistics.fmean(w["deqscore"] for w in windows) if windows else 0.0,
        "lightning_syncs_mean": statistics.fmean(w["lightning"] for w in windows) if windows else 0.0,
        "other_syncs_mean": statistics.fmean(w["other"] for w in windows) if windows else 0.0,
        "step_ms_median": 1e3 * statistics.median(steps) if steps else float("nan"),
        # the fastest step: on a machine shared with other jobs the least disturbed measurement
        "step_ms_min": 1e3 * min(steps) if steps else float("nan"),
    }


def _cli_main() -> Callable[[list[str]], Any]:
    from deqscore.cli.train import main  # imported when a run is asked for: the CLI pulls in every family

    return main


#: the fast configuration's DEQ options (fixed iteration counts) and callback, as command-line arguments
def fast_args(max_iter: int, ift_max_iter: int | None = None) -> list[str]:
    deq = "--model.init_args.net.init_args.deq.init_args"
    args = [f"{deq}.check_every", "0", f"{deq}.max_iter", str(max_iter),
            "--trainer.callbacks+=deqscore.lightning.run_hooks.SyncFreeSteps"]
    return args + ([f"{deq}.ift_max_iter", str(ift_max_iter)] if ift_max_iter is not None else [])


def _small(family: str, data_dir: str | None) -> list[str]:
    """Small sizes of the family's DEQ config (a CPU measures the count and the per-step overhead)."""
    net = "--model.init_args.net.init_args"
    common = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
              "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
              "--trainer.max_epochs", "1",
              "--data.init_args.train_subset", "2048", "--data.init_args.batch_size", "32"]
    if data_dir:
        common += ["--data.init_args.data_dir", data_dir]
    if family == "nice":
        return ["--config", str(ROOT / "configs/nice/deq.yaml"), f"{net}.hidden", "64", *common]
    return ["--config", str(ROOT / "configs/ncsn/deq_mnist.yaml"), f"{net}.ngf", "8", *common,
            "--data.init_args.num_workers", "0", "--trainer.val_check_interval", "null"]


def measure_family(family: str, fast: bool, steps: int, runs_root: str, data_dir: str | None = None,
                   extra: list[str] | None = None) -> dict[str, Any]:
    """Host syncs and step times of ``steps`` training steps of one family's DEQ config through the CLI."""
    name = f"{family}_{'fast' if fast else 'default'}"
    args = [*_small(family, data_dir), "--runs_root", runs_root, "--run_name", name, "--trainer.max_steps", str(steps),
            *(extra or [])]
    counter = HostSyncCounter()
    windows = StepWindows(counter)
    main = _cli_main()
    torch.manual_seed(0)
    with counter, warnings.catch_warnings(), _extra_callback(windows):
        warnings.simplefilter("ignore")
        cli = main(["fit", *args])
    row = {"family": family, "configuration": "fast" if fast else "default", **per_step(counter, windows.times)}
    metrics = cli.trainer.callback_metrics
    for key in ("deq/nstep", "deq/abs_residual", "deq/rel_residual"):
        if f"train/{key}" in metrics:
            row[key.split("/")[1]] = float(metrics[f"train/{key}"])
    row["deqscore_sites"] = counter.sites("deqscore")
    row["lightning_sites"] = counter.sites("lightning")
    row["other_sites"] = counter.sites("other")
    return row


@contextmanager
def _extra_callback(callback: pl.Callback) -> Iterator[None]:
    """Add ``callback`` to every trainer built while active (the CLI builds its own)."""
    original = pl.Trainer.__init__

    @functools.wraps(original)  # the CLI reads the trainer's options from this signature
    def init(self: pl.Trainer, *args: Any, callbacks: Any = None, **kwargs: Any) -> None:
        callbacks = [*(callbacks or []), callback] if not isinstance(callbacks, pl.Callback) else [callbacks, callback]
        original(self, *args, callbacks=callbacks, **kwargs)

    pl.Trainer.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        pl.Trainer.__init__ = original  # type: ignore[method-assign]


def sync_rows(steps: int, runs_root: str) -> list[dict[str, Any]]:
    """Default and fast rows of NICE and NCSN; the fast run's fixed iteration counts are the default run's
    (forward: its mean ``deq/nstep``; NCSN's IFT backward: its backward iterations per step, from the count)."""
    rows = []
    for family in ("nice", "ncsn"):
        default = measure_family(family, False, steps, runs_root)
        iters = {"max_iter": math.ceil(default.get("nstep", 12))}
        if family == "ncsn":  # one DEQ layer, one IFT backward solve per step: its checks are its iterations
            backward = sum(n for site, n in default["deqscore_sites"].items() if site.startswith("tolist layer.py"))
            iters["ift_max_iter"] = max(1, math.ceil(backward / steps))
        log(f"{family} default: {_summary(default)}; fast with {iters}")
        fast = measure_family(family, True, steps, runs_root, extra=fast_args(**iters))
        fast["fixed_iterations"] = iters
        log(f"{family} fast: {_summary(fast)}")
        rows += [default, fast]
    return rows


def _summary(row: dict[str, Any]) -> str:
    return (f"{row['deqscore_syncs_mean']:.1f} deqscore syncs/step (max {row['deqscore_syncs_max']}), "
            f"{row['lightning_syncs_mean']:.1f} Lightning, {row['step_ms_median']:.0f} ms/step (min "
            f"{row['step_ms_min']:.0f})")


def log(msg: str) -> None:
    print(f"[sync] {msg}", flush=True)


def _mnist_batch(n: int) -> torch.Tensor:
    from deqscore.data import MNISTDataModule

    dm = MNISTDataModule(transform="logit_squeeze", batch_size=n, train_subset=n, num_workers=0)
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))[0]


def _ssm_grad(net: torch.nn.Module, x: torch.Tensor, precision: str) -> tuple[torch.Tensor, float]:
    from deqscore.losses import SSM, score_from_log_prob

    net.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same projections in every precision
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = SSM()(score_from_log_prob(net.log_prob), x).mean()
    loss.backward()
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in net.parameters()])
    return grad.double(), float(loss)


def bf16_gradient_rows(hidden: int = 1000, batch: int = 32) -> list[dict[str, Any]]:
    """Phantom SSM gradient of a one-coupling DEQ-NICE on MNIST (logit_squeeze) under bf16 autocast vs float32,
    per solver; float32 vs float64 as the rounding floor."""
    from deqscore.deq import DEQ
    from deqscore.models import NICE

    x = _mnist_batch(batch)
    rows = []
    for solver in ("picard", "anderson"):
        torch.manual_seed(0)
        deq = functools.partial(DEQ, solver=solver, tol=1e-6, max_iter=100, warn_on_nonconvergence=False)
        net = NICE(784, 1, "deq", hidden, deq=deq)
        g32, l32 = _ssm_grad(net, x, "fp32")
        g16, l16 = _ssm_grad(net, x, "bf16")
        g64, _ = _ssm_grad(net.double(), x.double(), "fp64")
        net.float()
        for name, g, ref in (("bf16 vs float32", g16, g32), ("float32 vs float64", g32, g64)):
            rows.append({"solver": solver, "comparison": name, "hidden": hidden, "batch": batch,
                         "cosine": float(torch.nn.functional.cosine_similarity(g, ref, dim=0)),
                         "rel_error": float((g - ref).norm() / ref.norm()),
                         "loss_rel_diff": abs(l16 - l32) / abs(l32) if name.startswith("bf16") else None})
            log(f"bf16 fidelity {solver} {name}: cosine {rows[-1]['cosine']:.6f}, "
                f"rel error {rows[-1]['rel_error']:.3e}")
    return rows


class _Curve(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.start = self.seconds = 0.0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start


def nice_run_rows(steps: int, runs_root: str, hidden: int = 64) -> list[dict[str, Any]]:
    """A short DEQ-NICE run in 32-bit and in bf16-mixed: loss curve ends and validation bits/dim."""
    net = "--model.init_args.net.init_args"
    rows = []
    for precision in ("32-true", "bf16-mixed"):
        curve = _Curve()
        args = ["--config", str(ROOT / "configs/nice/deq.yaml"), f"{net}.hidden", str(hidden),
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                "--trainer.max_epochs", "1", "--trainer.max_steps", str(steps), "--trainer.precision", precision,
                "--optimizer.init_args.lr", "1e-3",
                "--data.init_args.train_subset", str(32 * steps), "--data.init_args.val_subset", "512",
                "--data.init_args.batch_size", "32", "--data.init_args.eval_batch_size", "128",
                "--trainer.callbacks", "[]", "--runs_root", runs_root, "--run_name", f"nice_{precision}"]
        torch.manual_seed(0)
        with warnings.catch_warnings(), _extra_callback(curve):
            warnings.simplefilter("ignore")
            cli = _cli_main()(["fit", *args])
        metrics = cli.trainer.callback_metrics
        head, tail = curve.losses[:10], curve.losses[-20:]
        rows.append({"precision": precision, "steps": len(curve.losses), "hidden": hidden, "batch": 32,
                     "loss_first10": statistics.fmean(head), "loss_last20": statistics.fmean(tail),
                     "val_loss": float(metrics["val/loss"]), "val_bits_per_dim": float(metrics["val/bits_per_dim"]),
                     "seconds": curve.seconds, "curve": curve.losses})
        log(f"NICE {precision}: loss {rows[-1]['loss_first10']:.1f} -> {rows[-1]['loss_last20']:.1f}, val bits/dim "
            f"{rows[-1]['val_bits_per_dim']:.4f} ({curve.seconds:.0f} s)")
    return rows


SYNC_NOTE = (
    "Counted by wrapping `Tensor.item/tolist/__bool__/__float__/__int__/cpu` and filing each call under the calling "
    "frame's package; steps after the first (which measures the run's facts), Lightning's logging in between "
    "included. *other*: torch's own (on this run Adam's per-parameter `step` counters, CPU tensors that are no device "
    "wait on a GPU either; EMA's swap checks for NCSN). Fast: `SyncFreeSteps` callback, DEQ `check_every: 0` with the "
    "default run's iterations (its last step's `deq/nstep`; NCSN's IFT backward: its backward iterations per step) "
    "as the fixed counts. Small sizes (NICE hidden 64, NCSN ngf 8, batch 32): on a CPU the step time shows the "
    "overhead of the syncs' Python calls, not the device idle time they cause on a GPU; the CPU is shared with other "
    "jobs, so the median moves with their load and the minimum is the least disturbed step.")


def tables(rows: dict[str, list[dict[str, Any]]]) -> list[Table]:
    """The report's tables from the measured rows of each section (``rows[name]`` for name in :data:`SECTIONS`);
    the call sites of the deqscore syncs get a table of their own."""
    syncs = Table("syncs", "Host syncs and step time, default vs fast configuration", [
        Column("family", "family"), Column("configuration", "configuration"),
        Column("deqscore_syncs_mean", "deqscore syncs / step (mean)", ".1f"),
        Column("deqscore_syncs_max", "deqscore syncs / step (max)"),
        Column("lightning_syncs_mean", "Lightning syncs / step", ".1f"),
        Column("other_syncs_mean", "other / step", ".1f"), Column("step_ms_median", "step ms (median)", ".0f"),
        Column("step_ms_min", "step ms (min)", ".0f"), Column("nstep", "DEQ iterations (last step)", "g"),
        Column("fixed_iterations", "fixed iterations (fast)"), Column("abs_residual", "final abs residual", ".2e"),
    ], rows["syncs"], notes=[SYNC_NOTE])
    sites = Table("sync_sites", "Where the deqscore syncs are (calls over the whole run)", [
        Column("family", "family"), Column("configuration", "configuration"), Column("site", "call site"),
        Column("calls", "calls")], [{"family": r["family"], "configuration": r["configuration"], "site": site,
                                      "calls": n} for r in rows["syncs"] for site, n in r["deqscore_sites"].items()])
    bf16 = Table("bf16_gradient", "bf16 autocast: phantom SSM gradient fidelity", [
        Column("solver", "solver"), Column("comparison", "comparison"), Column("cosine", "cosine", ".6f"),
        Column("rel_error", "relative error", ".3e"), Column("loss_rel_diff", "loss relative difference", ".2e"),
    ], rows["bf16_gradient"])
    if bf16.rows:
        g = bf16.rows[0]
        bf16.notes.append(
            f"One-coupling DEQ-NICE (784-d, DEQ block hidden {g['hidden']}, phantom K=2, tol 1e-6), batch {g['batch']} "
            "of MNIST (logit_squeeze), SSM with the same projections; the solve is float32 in every case, the phantom "
            "steps and the rest of the network run under the precision compared.")
    run = Table("nice_run", "Short DEQ-NICE run, bf16-mixed vs 32-bit", [
        Column("precision", "precision"), Column("steps", "steps"),
        Column("loss_first10", "train loss (first 10)", ".1f"), Column("loss_last20", "train loss (last 20)", ".1f"),
        Column("val_loss", "val loss", ".1f"), Column("val_bits_per_dim", "val bits/dim", ".4f"),
        Column("seconds", "seconds", ".0f"),
    ], rows["nice_run"])
    if run.rows:
        r = run.rows[0]
        run.notes.append(
            f"configs/nice/deq.yaml with hidden {r['hidden']}, batch {r['batch']}, Adam lr 1e-3, {r['steps']} steps, "
            "validation on 512 images; bfloat16 matmuls are emulated on this CPU, so the seconds say nothing of bf16 "
            "speed on a GPU.")
    return [syncs, sites, bf16, run]


SECTIONS = ("syncs", "bf16_gradient", "nice_run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=12, help="training steps per sync row")
    parser.add_argument("--run-steps", type=int, default=200, help="steps of the short bf16 vs 32-bit NICE run")
    parser.add_argument("--hidden", type=int, default=1000, help="DEQ block width of the bf16 gradient rows")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="measure only these; the others are kept from an existing sync.json in --out")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Measure the sections ``args`` names (the others are read back from ``sync.json`` in ``--out``) and write
    ``sync.json`` and ``sync.md``."""
    runs_root = tempfile.mkdtemp(prefix="deqscore-sync-")
    previous = args.out / "sync.json"
    kept = set(SECTIONS) - set(args.sections)
    if kept and not previous.is_file():
        parser.error(f"--sections: {', '.join(sorted(kept))} not measured and no {previous} to keep them from")
    try:
        rows = {name: section_rows(read_result(previous), name) for name in kept}
    except ResultFormatError as err:
        parser.error(str(err))
    measure = {"syncs": lambda: sync_rows(args.steps, runs_root),
               "bf16_gradient": lambda: bf16_gradient_rows(args.hidden),
               "nice_run": lambda: nice_run_rows(args.run_steps, runs_root)}
    for section in args.sections:
        rows[section] = measure[section]()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    header = {**environment(device), "lightning": pl.__version__, "measured": ", ".join(args.sections)}
    doc = write_result(args.out, "sync", Result(TITLE, header, {}, tables(rows)))
    log(f"written {args.out / 'sync.md'}")
    return doc
