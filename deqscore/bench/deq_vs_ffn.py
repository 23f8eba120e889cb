"""DEQ vs feed-forward score networks of equal size, on densities whose score is known in closed form.

Run::

    python -m deqscore.bench.deq_vs_ffn                                  # the stated budget (see --help)
    python -m deqscore.bench.deq_vs_ffn --steps 20 --seeds 1 --dims 2 --out /tmp/dvf   # a smoke run

Densities in d dimensions (exact rejection samplers, scores in closed form):

* ``steep`` k: ``p(x) ~ N(x; 0, I) sigmoid(k x_1)``, score ``-x + e_1 k (1 - sigmoid(k x_1))``;
* ``osc`` w: ``p(x) ~ N(x; 0, I) (1 + a cos(w x_1))``, a = 0.5, score ``-x - e_1 a w sin(w x_1) / (1 + a cos(w x_1))``.

Networks (tanh, output = the score): a DEQ-MLP ``z* = tanh(W z* + A x + a)``, ``s = C z* + c`` on deqscore's DEQ
layer (Anderson, phantom backward) and MLPs of 2, 4 and 8 hidden layers whose width is chosen to match the DEQ's
parameter count within 5 %. Each is trained with DSM (one small sigma) and with SSM-VR on fresh samples for the
same number of Adam steps; the held-out Fisher divergence ``E_p ||s(x) - grad log p(x)||^2`` (and its x_1 part),
parameters, activation memory of one step, time per step, solver iterations, the largest absolute weight and the
participation ratio of the last hidden layer (the fixed point for the DEQ) are recorded per unit (density x d x
network x loss x seed) in ``<out>/units/<unit>.json``; a unit already on disk is skipped, so a stopped run resumes.
Then ``deq_vs_ffn.md`` / ``.json`` (seed means and standard errors) and PNG plots are written under ``--out``.

Prediction stated before running: the DEQ's advantage (best MLP Fisher divergence / DEQ Fisher divergence) grows
with the steepness k and the frequency w.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..deq import DEQ
from ..losses import denoising_score_matching, sliced_score_matching
from ..metrics import parameter_count, step_activation_bytes
from .measure import environment, log
from .report import Column, Table, table_markdown
from .units import mean_stderr

Tensor = torch.Tensor
OSC_AMPLITUDE = 0.5
DEFAULT_OUT = "benchmarks/results/deq_vs_ffn"
FFN_DEPTHS = (2, 4, 8)
LOSSES = ("dsm", "ssm_vr")


@dataclass(frozen=True)
class Density:
    """A density on R^d known up to a constant, with an exact sampler and its score."""

    family: str  # "steep" or "osc"
    param: float  # k or w

    @property
    def name(self) -> str:
        return f"{self.family}{self.param:g}"

    def _accept(self, x1: Tensor) -> Tensor:
        if self.family == "steep":
            return torch.sigmoid(self.param * x1)
        return (1 + OSC_AMPLITUDE * torch.cos(self.param * x1)) / (1 + OSC_AMPLITUDE)

    def sample(self, n: int, d: int, gen: torch.Generator) -> Tensor:
        """``n`` exact samples: N(0, I) proposals accepted with probability <= 1 (rate >= 1/3)."""
        out, have = [], 0
        while have < n:
            x = torch.randn(3 * n, d, generator=gen)
            keep = torch.rand(3 * n, generator=gen) < self._accept(x[:, 0])
            out.append(x[keep])
            have += int(keep.sum())
        return torch.cat(out)[:n]

    def score(self, x: Tensor) -> Tensor:
        """``grad log p(x)``."""
        s = -x.clone()
        x1 = x[:, 0]
        if self.family == "steep":
            s[:, 0] += self.param * torch.sigmoid(-self.param * x1)
        else:
            w, a = self.param, OSC_AMPLITUDE
            s[:, 0] -= a * w * torch.sin(w * x1) / (1 + a * torch.cos(w * x1))
        return s


DENSITIES = tuple(Density("steep", k) for k in (1, 4, 16, 64)) + tuple(Density("osc", w) for w in (1, 4, 16))


class TanhMap(nn.Module):
    """``func(z, u) = tanh(W z + u)``; W starts at spectral scale about 0.5 (a contraction)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=False)
        nn.init.normal_(self.lin.weight, std=0.25 / math.sqrt(width))

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return torch.tanh(self.lin(z) + u)


class DEQScore(nn.Module):
    """``s(x) = C z* + c``, ``z* = tanh(W z* + A x + a)``."""

    def __init__(self, dim: int, width: int, phantom_steps: int = 2):
        super().__init__()
        self.inp = nn.Linear(dim, width)
        self.deq = DEQ(TanhMap(width), solver="anderson", tol=1e-4, stop_mode="rel", max_iter=40,
                       phantom_steps=phantom_steps, warn_on_nonconvergence=False)
        self.out = nn.Linear(width, dim)

    def hidden(self, x: Tensor) -> Tensor:
        return self.deq(self.inp(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.hidden(x))


class MLPScore(nn.Module):
    """``depth`` tanh hidden layers of ``width``, output the score."""

    def __init__(self, dim: int, width: int, depth: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(dim if i == 0 else width, width), nn.Tanh()]
        self.body = nn.Sequential(*layers)
        self.out = nn.Linear(width, dim)

    def hidden(self, x: Tensor) -> Tensor:
        return self.body(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.hidden(x))


def mlp_parameters(dim: int, width: int, depth: int) -> int:
    """Parameters of :class:`MLPScore`."""
    return dim * width + width + (depth - 1) * (width * width + width) + width * dim + dim


def matched_width(dim: int, depth: int, target: int) -> int:
    """The MLP width whose parameter count is closest to ``target``.

    >>> matched_width(2, 2, mlp_parameters(2, 40, 2))
    40
    """
    return min(range(1, 4 * int(math.sqrt(target)) + 8), key=lambda w: abs(mlp_parameters(dim, w, depth) - target))


def build(model: str, dim: int, deq_width: int, phantom_steps: int = 2) -> nn.Module:
    """``"deq"`` or ``"ffn<depth>"``, the MLP matched to the DEQ's parameter count."""
    if model == "deq":
        return DEQScore(dim, deq_width, phantom_steps)
    depth = int(model[3:])
    target = parameter_count(DEQScore(dim, deq_width))
    return MLPScore(dim, matched_width(dim, depth, target), depth)


def loss_fn(loss: str, sigma: float) -> Callable[[nn.Module, Tensor], Tensor]:
    if loss == "dsm":
        return lambda net, x: denoising_score_matching(net, x, sigma).mean()
    return lambda net, x: sliced_score_matching(net, x, variance_reduction=True).mean()


def participation_ratio(H: Tensor) -> float:
    """``(tr C)^2 / tr(C^2)`` of the feature covariance C: how many directions the features use."""
    H = H - H.mean(0)
    eig = torch.linalg.eigvalsh(H.T @ H / len(H)).clamp_min(0)
    return float(eig.sum() ** 2 / (eig**2).sum().clamp_min(1e-30))


def fisher(net: nn.Module, density: Density, x: Tensor) -> tuple[float, float]:
    """Held-out Fisher divergence ``E ||s - s*||^2`` and its x_1 part."""
    with torch.no_grad():
        err = (net(x) - density.score(x)) ** 2
    return float(err.sum(1).mean()), float(err[:, 0].mean())


def run_unit(density: Density, dim: int, model: str, loss: str, seed: int, args: argparse.Namespace) -> dict:
    """Train one network on one density with one loss and seed; its record."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    net = build(model, dim, args.deq_width, args.phantom_steps)
    step_loss = loss_fn(loss, args.sigma)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    x0 = density.sample(args.batch, dim, gen)
    act_bytes = step_activation_bytes(lambda: step_loss(net, x0).backward(), net)
    iters: list[int] = []
    start = time.perf_counter()
    for _ in range(args.steps):
        x = density.sample(args.batch, dim, gen)
        opt.zero_grad(set_to_none=True)
        value = step_loss(net, x)
        value.backward()
        opt.step()
        if model == "deq":
            iters.append(net.deq.stats.nstep)
    seconds = time.perf_counter() - start
    held_out = density.sample(args.eval_samples, dim, torch.Generator().manual_seed(99))
    fd, fd1 = fisher(net, density, held_out)
    with torch.no_grad():
        pr = participation_ratio(net.hidden(held_out))
    return {
        "density": density.name, "family": density.family, "param": density.param, "dim": dim, "model": model,
        "loss": loss, "seed": seed, "steps": args.steps, "fisher": fd, "fisher_x1": fd1,
        "parameters": parameter_count(net), "activation_kib": act_bytes / 1024,
        "ms_per_step": 1e3 * seconds / args.steps,
        "solver_iters": sum(iters) / len(iters) if iters else None,
        "max_abs_weight": max(float(p.detach().abs().max()) for p in net.parameters()),
        "participation_ratio": pr, "final_loss": float(value.detach()),
    }


def unit_name(density: Density, dim: int, model: str, loss: str, seed: int, args: argparse.Namespace) -> str:
    """The unit's file stem; it names the budget too, so a run at another budget does not reuse it."""
    budget = f"n{args.steps}_b{args.batch}_lr{args.lr:g}_sig{args.sigma:g}_w{args.deq_width}_K{args.phantom_steps}"
    return f"{density.name}_d{dim}_{model}_{loss}_s{seed}_{budget}"


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every unit, skipping those recorded under ``<out>/units`` (with ``--report-only``, missing ones too)."""
    units_dir = Path(args.out) / "units"
    units_dir.mkdir(parents=True, exist_ok=True)
    records = []
    plan = [(den, d, m, lo, s) for d in args.dims for den in args.densities for lo in args.losses
            for m in args.models for s in range(args.seeds)]
    for i, (den, d, m, lo, s) in enumerate(plan):
        path = units_dir / f"{unit_name(den, d, m, lo, s, args)}.json"
        if path.exists():
            records.append(json.loads(path.read_text()))
            continue
        if args.report_only:
            continue
        rec = run_unit(den, d, m, lo, s, args)
        path.write_text(json.dumps(rec, indent=1))
        records.append(rec)
        log(f"{i + 1}/{len(plan)} {path.stem}: fisher {rec['fisher']:.4g} ({rec['ms_per_step']:.1f} ms/step)")
    return records


def summarise(records: list[dict]) -> list[dict]:
    """One row per (d, density, loss, network): seed means and standard errors."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["dim"], r["family"], r["param"], r["loss"], r["model"]), []).append(r)
    rows = []
    for (dim, family, param, loss, model), rs in sorted(groups.items(), key=lambda kv: kv[0]):
        fd, fd_se = mean_stderr([r["fisher"] for r in rs])
        fd1, fd1_se = mean_stderr([r["fisher_x1"] for r in rs])
        iters = [r["solver_iters"] for r in rs if r["solver_iters"] is not None]
        rows.append({
            "dim": dim, "family": family, "param": param, "loss": loss, "model": model, "seeds": len(rs),
            "fisher": fd, "fisher_se": fd_se, "fisher_x1": fd1, "fisher_x1_se": fd1_se,
            "parameters": rs[0]["parameters"], "activation_kib": mean_stderr([r["activation_kib"] for r in rs])[0],
            "ms_per_step": mean_stderr([r["ms_per_step"] for r in rs])[0],
            "solver_iters": mean_stderr(iters)[0] if iters else None,
            "max_abs_weight": mean_stderr([r["max_abs_weight"] for r in rs])[0],
            "participation_ratio": mean_stderr([r["participation_ratio"] for r in rs])[0],
        })
    return rows


def advantages(rows: list[dict]) -> list[dict]:
    """Per (d, density, loss): best MLP Fisher / DEQ Fisher (> 1: the DEQ is better), with a delta-method
    standard error, and the log-log slope of the advantage against k or w per (d, family, loss)."""
    out = []
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["dim"], r["family"], r["param"], r["loss"]), {})[r["model"]] = r
    for (dim, family, param, loss), models in sorted(by_key.items()):
        if "deq" not in models or len(models) < 2:
            continue
        deq = models["deq"]
        best = min((m for k, m in models.items() if k != "deq"), key=lambda m: m["fisher"])
        ratio = best["fisher"] / deq["fisher"]
        rel = [m["fisher_se"] / m["fisher"] for m in (best, deq) if m["fisher_se"] is not None]
        out.append({"dim": dim, "family": family, "param": param, "loss": loss, "best_ffn": best["model"],
                    "advantage": ratio, "advantage_se": ratio * math.sqrt(sum(x * x for x in rel)) if rel else None})
    return out


def trend(adv: list[dict]) -> list[dict]:
    """Least-squares slope of log advantage against log k (or w) per (d, family, loss), with the standard error
    propagated from the points' (delta-method) errors. The prediction is *supported* where the slope exceeds twice
    its error, *contradicted* where it is below minus twice, *inconclusive* otherwise."""
    groups: dict[tuple, list[dict]] = {}
    for a in adv:
        groups.setdefault((a["dim"], a["family"], a["loss"]), []).append(a)
    rows = []
    for (dim, family, loss), rs in sorted(groups.items()):
        if len(rs) < 2:
            continue
        xs = [math.log(r["param"]) for r in rs]
        ys = [math.log(r["advantage"]) for r in rs]
        mx = sum(xs) / len(xs)
        weights = [(x - mx) / sum((x - mx) ** 2 for x in xs) for x in xs]
        slope = sum(w * y for w, y in zip(weights, ys, strict=True))
        rel = [(r["advantage_se"] or 0.0) / r["advantage"] for r in rs]
        se = math.sqrt(sum((w * e) ** 2 for w, e in zip(weights, rel, strict=True)))
        verdict = "supported" if slope > 2 * se else "contradicted" if slope < -2 * se else "inconclusive"
        rows.append({"dim": dim, "family": family, "loss": loss, "slope": slope, "slope_se": se,
                     "advantage_first": rs[0]["advantage"], "advantage_last": rs[-1]["advantage"],
                     "verdict": verdict})
    return rows


def tables(rows: list[dict], adv: list[dict], trends: list[dict], args: argparse.Namespace) -> list[Table]:
    for r in rows:
        r["fisher_cell"] = f"{r['fisher']:.4g}" + (f" ± {r['fisher_se']:.2g}" if r["fisher_se"] is not None else "")
        r["fisher_x1_cell"] = f"{r['fisher_x1']:.4g}" + (
            f" ± {r['fisher_x1_se']:.2g}" if r["fisher_x1_se"] is not None else "")
    for a in adv:
        a["advantage_cell"] = f"{a['advantage']:.3g}" + (
            f" ± {a['advantage_se']:.2g}" if a["advantage_se"] is not None else "")
    main = Table("results", "Held-out Fisher divergence (seed mean ± standard error) and costs", [
        Column("dim", "d"), Column("family", "density"), Column("param", "k / w", "g"), Column("loss", "loss"),
        Column("model", "network"), Column("fisher_cell", "Fisher div."), Column("fisher_x1_cell", "x_1 part"),
        Column("parameters", "params"), Column("activation_kib", "act. mem. (KiB)", ".0f"),
        Column("ms_per_step", "ms / step", ".1f"), Column("solver_iters", "solver iters", ".1f"),
        Column("max_abs_weight", "max |w|", ".2f"), Column("participation_ratio", "PR", ".1f"),
    ], rows, notes=[
        f"{args.steps} Adam steps (lr {args.lr}), batch {args.batch} of fresh exact samples, {args.seeds} seeds; "
        f"Fisher divergence on {args.eval_samples} held-out samples; DSM at sigma = {args.sigma} (sigma^2 weighting), "
        "SSM-VR with one Rademacher projection.",
        f"deq: DEQ-MLP of width {args.deq_width} (Anderson, rel. tol 1e-4, max 40 iterations, "
        f"{args.phantom_steps} phantom steps); "
        "ffnL: L tanh hidden layers, width matched to the DEQ's parameters within 5 %.",
        "act. mem.: tensors saved for backward by one training step (deqscore.metrics.step_activation_bytes); "
        "PR: participation ratio of the last hidden layer (the DEQ's fixed point) on the held-out samples.",
    ])
    adv_table = Table("advantage", "DEQ advantage: best MLP Fisher / DEQ Fisher (> 1: DEQ better)", [
        Column("dim", "d"), Column("family", "density"), Column("param", "k / w", "g"), Column("loss", "loss"),
        Column("best_ffn", "best MLP"), Column("advantage_cell", "advantage"),
    ], adv)
    trend_table = Table("trend", "Prediction: the advantage grows with k and w", [
        Column("dim", "d"), Column("family", "density"), Column("loss", "loss"),
        Column("slope", "slope of log adv. vs log k (or w)", ".3f"), Column("slope_se", "its s.e.", ".3f"),
        Column("advantage_first", "adv. at smallest", ".3g"), Column("advantage_last", "adv. at largest", ".3g"),
        Column("verdict", "prediction"),
    ], trends, notes=["supported: slope > 2 s.e.; contradicted: slope < -2 s.e.; inconclusive otherwise. An "
                      "advantage far below 1 throughout means the DEQ lost at every k or w, whatever the slope."])
    return [main, adv_table, trend_table]


def plot(rows: list[dict], adv: list[dict], out: Path) -> list[str]:
    """Fisher divergence against k / w per network, and the advantage; PNG files (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots")
        return []
    written = []
    dims, losses = sorted({r["dim"] for r in rows}), sorted({r["loss"] for r in rows})
    for family, label in (("steep", "k"), ("osc", "w")):
        fig, axes = plt.subplots(len(dims), len(losses), figsize=(5 * len(losses), 3.6 * len(dims)), squeeze=False)
        for i, dim in enumerate(dims):
            for j, loss in enumerate(losses):
                ax = axes[i][j]
                for model in sorted({r["model"] for r in rows}):
                    rs = sorted((r for r in rows if (r["dim"], r["family"], r["loss"], r["model"]) ==
                                 (dim, family, loss, model)), key=lambda r: r["param"])
                    if rs:
                        ax.errorbar([r["param"] for r in rs], [r["fisher"] for r in rs],
                                    yerr=[r["fisher_se"] or 0 for r in rs], marker="o", capsize=3, label=model)
                ax.set(xscale="log", yscale="log", xlabel=label, ylabel="Fisher divergence",
                       title=f"{family}, d = {dim}, {loss}")
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"fisher_{family}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(a["dim"], a["family"], a["loss"]) for a in adv}):
        rs = sorted((a for a in adv if (a["dim"], a["family"], a["loss"]) == key), key=lambda a: a["param"])
        ax.errorbar([a["param"] for a in rs], [a["advantage"] for a in rs], yerr=[a["advantage_se"] or 0 for a in rs],
                    marker="o", capsize=3, label=f"d={key[0]} {key[1]} {key[2]}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="k (steep) / w (osc)", ylabel="best MLP / DEQ Fisher")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "advantage.png", dpi=110)
    plt.close(fig)
    return [*written, "advantage.png"]


def write(records: list[dict], args: argparse.Namespace, env: dict) -> dict:
    """Tables (md + json) and plots under ``--out``; the JSON document."""
    out = Path(args.out)
    rows = summarise(records)
    adv = advantages(rows)
    trends = trend(adv)
    all_tables = tables(rows, adv, trends, args)
    pngs = plot(rows, adv, out)
    settings = {k: v for k, v in vars(args).items() if k not in ("densities", "report_only")}
    settings["units"] = len(records)
    settings["densities"] = [d.name for d in args.densities]
    doc = {"environment": env, "settings": settings, "plots": pngs,
           "sections": {t.name: t.as_dict() for t in all_tables}}
    md = ["# DEQ vs feed-forward score networks on densities with known scores", ""]
    md += [f"* **{k}**: {v}" for k, v in env.items()]
    md += ["", "Prediction (stated before running): the DEQ's advantage grows with k and w.", ""]
    md += [table_markdown(t) for t in all_tables]
    md += [f"![{p}]({p})" for p in pngs]
    (out / "deq_vs_ffn.md").write_text("\n".join(md) + "\n")
    (out / "deq_vs_ffn.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per unit")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sigma", type=float, default=0.05, help="the DSM noise level")
    parser.add_argument("--deq-width", type=int, default=64)
    parser.add_argument("--phantom-steps", type=int, default=2, help="K of the DEQ's phantom backward")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--dims", default="2,8")
    parser.add_argument("--densities", default=",".join(d.name for d in DENSITIES),
                        help="from " + ", ".join(d.name for d in DENSITIES))
    parser.add_argument("--models", default="deq," + ",".join(f"ffn{L}" for L in FFN_DEPTHS))
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--eval-samples", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--report-only", action="store_true",
                        help="tables and plots from the units already on disk; train nothing")
    args = parser.parse_args(argv)
    known = {d.name: d for d in DENSITIES}
    names = [n for n in args.densities.split(",") if n]
    if unknown := sorted(set(names) - set(known)):
        parser.error(f"unknown densities {unknown}; choose from {sorted(known)}")
    args.densities = [known[n] for n in names]
    args.dims = [int(v) for v in args.dims.split(",") if v]
    args.models = [m for m in args.models.split(",") if m]
    if bad := [m for m in args.models if m != "deq" and not (m.startswith("ffn") and m[3:].isdigit())]:
        parser.error(f"unknown models {bad}; use deq and ffn<depth>")
    args.losses = [lo for lo in args.losses.split(",") if lo]
    if bad := sorted(set(args.losses) - set(LOSSES)):
        parser.error(f"unknown losses {bad}; choose from {LOSSES}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    env = environment(torch.device("cpu"))
    records = run_all(args)
    return write(records, args, env)


if __name__ == "__main__":
    main()
