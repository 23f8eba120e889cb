"""Section ``depth``: activation memory against depth, per family, DEQ against explicit stacks of its own block.

For each declared family's depth entries (:data:`deqlab.entries.DEPTHS`) the benchmark builds the
module as training does and measures one training step (the config's loss, forward and backward,
:func:`deqlab.measure.loss_step_bytes`) for

* **explicit, depth d** (d = 2, 4, 8, 16): every DEQ layer replaced by :class:`UntiedStack`, d untied copies of the
  map the DEQ iterates, applied in turn from ``z = 0`` with the same injection ``u``; the explicit net and the DEQ
  then differ only in weight tying and in how the stack is differentiated;
* **DEQ, K phantom steps** (K = 1, 2, 4) at 8, 32 and 128 solver iterations (a tolerance no solve meets forces
  them), the phantom backward of the config otherwise;
* **DEQ, implicit**: the exact backward of every order (docs/method.md 2.9) at the same iterations (forward and
  adjoint solves alike).

The DEQ's *effective depth* is the solver's mean iteration count at the config's tolerance on a batch of real
data after a short training run of the config (the entry's ``train_args``), marked on the plots. One PNG per family
(memory against depth or iterations, one line per variant) is written beside the report, ``depth_<family>.png``.

Every measured unit (a family's rows, a family's effective depth) is written to ``<out>/depth_units/`` when done and
read back instead of measured again, so an interrupted run continues where it stopped (delete the unit's file, or
the folder, to measure again; a unit recorded with other settings is measured again).

Run::

    python -m deqlab --sections depth --out benchmarks/results/depth [--quick]
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
from torch import nn

from deqscore.configfiles import composed_text
from deqscore.deq import DEQ
from deqscore.lightning.base import ScoreModule
from deqscore.metrics import parameter_count
from deqscore.sampling import pyplot

from .configs import ROOT, Options, build
from .entries import Depth, depth_entries
from .measure import MIB, log, loss_step_bytes
from .report import Column, Table
from .settings import FORCED_TOL, Settings
from .units import recorded, repo_relative

DEPTHS = {"full": (2, 4, 8, 16), "quick": (1, 2)}
PHANTOM_STEPS = {"full": (1, 2, 4), "quick": (1, 2)}
ITERATIONS = {"full": (8, 32, 128), "quick": (2, 8)}
EFFECTIVE_DEPTH_MAX_ITER = 500  # solver cap when measuring the iterations the config's tolerance needs


class UntiedStack(nn.Module):
    """``depth`` untied copies of a DEQ's map ``f(z, u)``, applied in turn from ``z = 0``: the explicit network of
    that depth made of the block the DEQ iterates (the copies are re-initialised, so their weights differ).

    >>> from deqscore.models.nice import NICEDEQMap
    >>> stack = UntiedStack(NICEDEQMap(8), depth=3)
    >>> stack(torch.randn(2, 8)).shape, len(stack.blocks)
    (torch.Size([2, 8]), 3)
    """

    def __init__(self, func: nn.Module, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(_reinitialised(func) for _ in range(depth))

    def forward(self, u: torch.Tensor, z0: torch.Tensor | None = None) -> torch.Tensor:
        z = torch.zeros_like(u) if z0 is None else z0
        for block in self.blocks:
            z = block(z, u)
        return z


def _reinitialised(func: nn.Module) -> nn.Module:
    block = copy.deepcopy(func)
    for m in block.modules():
        if m is not block and hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return block


def untie(module: nn.Module, depth: int) -> nn.Module:
    """``module`` with every :class:`DEQ` layer replaced by an :class:`UntiedStack` of its map (in place)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DEQ):
                setattr(parent, name, UntiedStack(child.func, depth))
    return module


# ---------------------------------------------------------------- the families


def _gaussian(module: ScoreModule, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, module.net.dim, generator=gen)


def _pixels(module: ScoreModule, n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.rand(n, module.net.dim, generator=gen)
    return x.bernoulli(generator=gen) if getattr(module, "binarize", False) else x


def _dkef_inputs(module: ScoreModule, n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(max(n, module.net.n_centres), module.net.dim, generator=gen)
    module.net.init_centres(x, gen)
    return x[:n]


def _module_loss(module: ScoreModule, x: torch.Tensor) -> torch.Tensor:
    return module.loss_terms(x)["loss"]


def _vae_score_loss(module: ScoreModule, x: torch.Tensor) -> torch.Tensor:
    return module.net.score_loss(x).mean()  # the score network's step: where its DEQ is trained


#: how a declared depth entry's measured step is fed (``Depth.inputs``) and what it differentiates (``Depth.loss``)
INPUTS = {"gaussian": _gaussian, "pixels": _pixels, "dkef_centres": _dkef_inputs}
LOSSES = {"module": _module_loss, "vae_score": _vae_score_loss}
_STEPS = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
VAL_ARGS = ["--trainer.limit_val_batches", "2"]


def depth_families() -> dict[str, Depth]:
    """Every declared family's depth entries (:mod:`deqlab.entries`), by entry name."""
    return depth_entries()


def _measure(family: Depth, mode: str, options: Options, depth: int | None) -> dict:
    """Parameters and activation memory of one training step of ``family`` built with ``options``; ``depth``:
    the DEQ layers untied into explicit stacks of that depth."""
    module = build(family.config, {**family.sizes[mode], **family.deq_options, **options}).train()
    if depth is not None:
        untie(module, depth)
    gen = torch.Generator().manual_seed(0)
    x = INPUTS[family.inputs](module, family.batch[mode], gen)

    def loss() -> torch.Tensor:
        torch.manual_seed(0)  # the same noise, projections and levels for every variant
        return LOSSES[family.loss](module, x)

    return {"params": parameter_count(module), "act_mib": loss_step_bytes(module, loss) / MIB}


def family_rows(family: Depth, mode: str) -> list[dict]:
    rows = []
    for depth in DEPTHS[mode]:
        m = _measure(family, mode, {}, depth)
        rows.append({"variant": "explicit", "depth": depth, **m})
        log(f"depth: {family.label}: explicit depth {depth}: {m['act_mib']:.2f} MiB")
    for k in PHANTOM_STEPS[mode]:
        for iters in ITERATIONS[mode]:
            opts = {"net.deq.phantom_steps": k, "net.deq.max_iter": iters, "net.deq.tol": FORCED_TOL,
                    "net.deq.warn_on_nonconvergence": False}
            m = _measure(family, mode, opts, None)
            rows.append({"variant": f"DEQ, K = {k}", "phantom_steps": k, "iterations": iters, **m})
            log(f"depth: {family.label}: DEQ K={k}, {iters} iterations: {m['act_mib']:.2f} MiB")
    for iters in ITERATIONS[mode]:  # the exact backward (docs/method.md 2.9): flat in the iterations too
        opts = {"net.deq.backward": "implicit", "net.deq.max_iter": iters, "net.deq.tol": FORCED_TOL,
                "net.deq.warn_on_nonconvergence": False}
        m = _measure(family, mode, opts, None)
        rows.append({"variant": "DEQ, implicit", "iterations": iters, **m})
        log(f"depth: {family.label}: DEQ implicit, {iters} iterations: {m['act_mib']:.2f} MiB")
    return rows


def effective_depth(family: Depth, mode: str) -> dict | None:
    """Train the config for the family's short run on real data, then the DEQ solver's mean iterations at the
    config's tolerance (cap :data:`EFFECTIVE_DEPTH_MAX_ITER`) on one validation batch, in eval mode."""
    if family.train_args is None:
        return None
    from deqscore.cli.train import main  # the training entry point itself (bench is above the CLI in no layer)
    from deqscore.lightning.run_hooks import batch_inputs

    with tempfile.TemporaryDirectory(prefix="deqscore-depth-") as tmp:
        args = ["fit", "--config", str(ROOT / family.config), "--runs_root", tmp, "--run_name", "depth",
                *_STEPS, *VAL_ARGS, *family.train_args[mode]]
        cli = main(args)
        module, dm = cli.model.eval(), cli.datamodule
        deqs = [m for m in module.modules() if isinstance(m, DEQ)]
        for d in deqs:
            d.max_iter, d.warm_start, d.warn_on_nonconvergence = EFFECTIVE_DEPTH_MAX_ITER, False, False
        x = module.prepare_batch(batch_inputs(next(iter(dm.val_dataloader()))))
        with torch.enable_grad():
            torch.manual_seed(0)
            LOSSES[family.loss](module, x)
        steps = [d.stats.nstep for d in deqs]
        converged = [bool(d.stats.converged) for d in deqs]
    return {"mean_iterations": sum(steps) / len(steps), "per_layer": steps, "converged": all(converged),
            "tol": deqs[0].tol, "stop_mode": deqs[0].stop_mode, "solver": deqs[0].solver,
            "training": repo_relative(" ".join(family.train_args[mode])), "batch": len(x)}


# ---------------------------------------------------------------- report


def plot(family: Depth, rows: list[dict], effective: dict | None, path: Path) -> None:
    """Memory against depth (explicit) or solver iterations (DEQ), log-log, the effective depth marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    explicit = [r for r in rows if r["variant"] == "explicit"]
    ax.plot([r["depth"] for r in explicit], [r["act_mib"] for r in explicit], "o-", color="black",
            label="explicit, depth d (untied blocks)")
    for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "explicit"):
        pts = [r for r in rows if r["variant"] == variant]
        ax.plot([r["iterations"] for r in pts], [r["act_mib"] for r in pts], "s--", label=f"{variant} (iterations)")
    if effective:
        ax.axvline(effective["mean_iterations"], color="grey", lw=1, ls=":")
        ax.annotate(f"effective depth {effective['mean_iterations']:.1f}", (effective["mean_iterations"], 0.97),
                    xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="depth d / solver iterations",
           ylabel="activation memory of one step (MiB)", title=family.label)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _flatness(rows: list[dict]) -> dict[str, float]:
    """Per DEQ variant: memory at the most iterations over memory at the fewest (1.0: flat)."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "explicit"):
        pts = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["iterations"])
        out[variant] = pts[-1]["act_mib"] / pts[0]["act_mib"]
    return out


def depth_table(results: dict[str, dict], mode: str, families: dict[str, Depth]) -> Table:
    table = Table("depth", "Activation memory against depth: explicit stacks of the DEQ's block vs the DEQ", [
        Column("family", "family"), Column("variant", "variant"), Column("depth", "depth d", "d"),
        Column("phantom_steps", "K", "d"), Column("iterations", "solver iterations", "d"),
        Column("params", "parameters", ","), Column("act_mib", "activation memory (MiB)", ".2f"),
    ])
    for name, res in results.items():
        table.rows += [{"family": families[name].label, **r} for r in res["rows"]]
    flat = {families[n].label: _flatness(r["rows"]) for n, r in results.items()}
    eff = {families[n].label: r["effective_depth"] for n, r in results.items()}
    table.meta.update({"flatness": flat, "effective_depth": eff,
                       "sizes": {n: {"options": families[n].sizes[mode], "batch": families[n].batch[mode]}
                                 for n in results}})
    table.notes += [
        "Each family's module is its DEQ config's (`build_module`) at the sizes in `meta.sizes`; 'explicit, "
        "depth d' replaces every DEQ layer by d untied, re-initialised copies of its map applied from z = 0 with "
        "the same injection; 'DEQ, K' is the config's DEQ with K phantom steps after a solve forced to the given "
        "iterations. One step: the config's loss (the VAE: the score network's SSM-VR step) and its backward.",
        "Flatness (memory at the most iterations / at the fewest, per DEQ variant): "
        + "; ".join(f"{fam}: " + ", ".join(f"{v} {x:.3f}" for v, x in vs.items()) for fam, vs in flat.items()),
        "Effective depth (mean solver iterations at the config's tolerance on a real validation batch after a "
        "short training run, eval mode): " + "; ".join(
            f"{fam}: " + (f"{e['mean_iterations']:.1f} ({e['solver']}, tol {e['tol']:g} {e['stop_mode']}, "
                          f"converged {e['converged']}; run: {e['training']})" if e else
                          "not measured (no real data of this shape offline)") for fam, e in eff.items()),
    ]
    return table


def depth(s: Settings, device: torch.device) -> Table:
    """The section: every family's rows and effective depth (measured, or read back from ``<out>/depth_units``),
    one PNG per family beside the report. Memory is counted in bytes saved by autograd, the same on any
    device: the section runs on the CPU."""
    del device
    out = Path(s.out_dir)
    results = {}
    families = depth_families()
    for name, family in families.items():
        settings = {"mode": s.mode, "sizes": family.sizes[s.mode], "batch": family.batch[s.mode],
                    "depths": DEPTHS[s.mode], "phantom_steps": PHANTOM_STEPS[s.mode],
                    "iterations": ITERATIONS[s.mode], "config": composed_text(ROOT / family.config),
                    "backward": ("phantom", "implicit")}  # units measured before the implicit rows: measured again
        rows = recorded(out / "depth_units" / f"{name}__rows.json", settings, lambda f=family: family_rows(f, s.mode))
        train = {"mode": s.mode, "args": family.train_args and [repo_relative(a) for a in family.train_args[s.mode]],
                 "config": settings["config"]}
        eff = recorded(out / "depth_units" / f"{name}__effective_depth.json", train,
                       lambda f=family: effective_depth(f, s.mode))
        results[name] = {"rows": rows, "effective_depth": eff}
        out.mkdir(parents=True, exist_ok=True)
        plot(family, rows, eff, out / f"depth_{name}.png")
    table = depth_table(results, s.mode, families)
    table.notes.append(f"Plots: {', '.join(f'depth_{n}.png' for n in results)} beside this file; measured units "
                       "under depth_units/ (an interrupted run continues from them).")
    return table
