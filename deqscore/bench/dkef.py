"""Section ``dkef``: the three DKEF feature networks (explicit shallow, explicit deep, DEQ) on RedWine and on the
synthetic ``highdim`` Gaussian, each trained for the same short budget with the two-stage step of
:class:`deqscore.lightning.DKEFModule` (alpha solved on the first half of the batch with ``create_graph=True``,
the SSM-VR loss on the second half), driven by a plain loop (Adam, gradient-norm clipping) so that the step itself
is measured. Per row: parameters, activation memory of one training step (``SavedTensorMeter``, the first step),
median time of the remaining steps, and after training (alpha refreshed on training points) the test
log-likelihood with its log Z standard error; on highdim also the true test log-likelihood and the Fisher
divergence to N(0, I).
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..data import UCIDataModule
from ..data.errors import DataNotFoundError
from ..deq import DEQ, deq_backward
from ..lightning.dkef import DKEFModule
from ..metrics import SavedTensorMeter, parameter_count
from ..models import DKEF
from .measure import MIB, log, sync
from .report import Column, Table, fmt_value
from .settings import Settings

ROOT = Path(__file__).resolve().parents[2]
FEATURE_NETS = (("explicit shallow", "shallow"), ("explicit deep", "deep"), ("DEQ", "deq"))
RATIO_KEYS = ("params", "act_mib", "time_ms")


# ---------------------------------------------------------------- building blocks (also used by the tests)


def deq_factory(s: Settings, **overrides: object) -> partial:
    """The DEQ layer of the ``deq`` feature nets (``overrides`` replace the settings' options)."""
    kwargs = {"solver": s.dkef_solver, "tol": s.dkef_tol, "max_iter": s.dkef_max_iter, "backward": "phantom",
              "phantom_steps": s.dkef_phantom_steps, **overrides}
    return partial(DEQ, **kwargs)


def build_dkef(s: Settings, kind: str, dim: int, bandwidth_init: str | None = None, **deq_overrides: object) -> DKEF:
    """A freshly initialised DKEF (seed ``s.seed``) with the ``kind`` feature nets."""
    torch.manual_seed(s.seed)
    return DKEF(dim, s.dkef_n_centres, s.dkef_hidden, kind, s.dkef_deep_layers, deq=deq_factory(s, **deq_overrides),
                bandwidth_init=bandwidth_init or s.dkef_bandwidth_init, bandwidth_points=s.dkef_alpha_points)


def make_module(net: DKEF, s: Settings) -> DKEFModule:
    """The Lightning module around ``net`` (only its loss and two-stage ``compute_loss`` are used), in train mode."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Attribute 'net' is an instance of `nn.Module`")
        module = DKEFModule(net, loss=s.dkef_loss)
    return module.train()


def loss_and_backward(module: DKEFModule, x: torch.Tensor) -> float:
    """Forward and backward of one two-stage training step (no optimiser update); the mean loss."""
    loss = module.compute_loss(x).mean()
    loss.backward()
    return loss.item()


def step_activation_mib(module: DKEFModule, x: torch.Tensor) -> float:
    """Activation memory (MiB) of one training step: storages saved for backward, parameters excluded."""
    params = list(module.parameters())
    module.zero_grad(set_to_none=True)
    with SavedTensorMeter(exclude=params) as meter:
        loss_and_backward(module, x)
    module.zero_grad(set_to_none=True)
    return meter.bytes / MIB


def refresh_alpha(module: DKEFModule, points: torch.Tensor, chunk: int) -> None:
    """Store alpha solved on ``points`` (the system is a mean over points: assembled in chunks of ``chunk``)."""
    gram = b = None
    for part in points.split(chunk):
        with torch.enable_grad():
            g, bb = module.alpha_system(part, create_graph=False)
        w = len(part) / len(points)
        gram, b = (w * g, w * bb) if gram is None else (gram + w * g, b + w * bb)
    with torch.no_grad():
        module.net.set_alpha(module.net.alpha_from_system(gram, b, differentiable=False))


# ---------------------------------------------------------------- data


@dataclass
class DKEFData:
    name: str
    dim: int
    train: torch.Tensor
    test: torch.Tensor
    datamodule: UCIDataModule


def data_root(s: Settings) -> Path:
    """``s.dkef_data_root``, relative to the repository root unless absolute."""
    root = Path(s.dkef_data_root)
    return root if root.is_absolute() else (ROOT / root).resolve()


def load_datasets(s: Settings, device: torch.device) -> tuple[list[DKEFData], list[str]]:
    """RedWine (when its file is there) and highdim at every ``s.dkef_dims``; and notes on what was skipped."""
    modules: list[tuple[str, UCIDataModule]] = []
    notes: list[str] = []
    if s.dkef_redwine:
        dm = UCIDataModule("redwine", root=str(data_root(s)), batch_size=s.dkef_batch, seed=s.dkef_data_seed)
        try:
            dm.setup()
            modules.append(("RedWine", dm))
        except DataNotFoundError:
            notes.append(f"RedWine skipped: winequality-red.csv is not in {data_root(s)}.")
            log(f"dkef: RedWine skipped (no winequality-red.csv in {data_root(s)})")
    for dim in s.dkef_dims:
        dm = UCIDataModule("highdim", dim=dim, batch_size=s.dkef_batch, seed=s.dkef_data_seed)
        dm.setup()
        modules.append(("highdim", dm))
    out = [DKEFData(name, dm.dim, dm.train_data.to(device), dm.test_data.to(device), dm) for name, dm in modules]
    return out, notes


def log_z_samples(s: Settings, data: DKEFData) -> int:
    """Importance samples of log Z for ``data``."""
    return s.dkef_log_z_samples if data.datamodule.is_synthetic else s.dkef_log_z_samples_redwine


def steps_for(s: Settings, dim: int) -> int:
    """Training steps at data dimension ``dim`` (``s.dkef_steps`` unless ``s.dkef_steps_by_dim`` overrides)."""
    return dict(s.dkef_steps_by_dim).get(dim, s.dkef_steps)


# ---------------------------------------------------------------- one row


class _IterationCounter:
    """Solver iterations of every forward of the DEQ layers inside a module."""

    def __init__(self, module: torch.nn.Module):
        self.counts: list[int] = []
        self.handles = [m.register_forward_hook(self._hook) for m in module.modules() if isinstance(m, DEQ)]

    def _hook(self, layer: DEQ, args: object, out: object) -> None:
        self.counts.append(layer.stats.nstep)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def train(module: DKEFModule, data: DKEFData, s: Settings, device: torch.device) -> dict:
    """The fixed training budget: activation memory of the first step, median time of the others, losses."""
    params = list(module.parameters())
    opt = torch.optim.Adam(params, lr=s.dkef_lr)
    gen = torch.Generator().manual_seed(s.seed)  # the same batches for every feature net
    torch.manual_seed(s.seed + 1)  # ... and the same projections
    counter = _IterationCounter(module)
    steps, losses, times, act_mib = steps_for(s, data.dim), [], [], float("nan")
    try:
        for i in range(steps):
            x = data.train[torch.randperm(len(data.train), generator=gen)[: s.dkef_batch].to(device)]
            opt.zero_grad(set_to_none=True)
            sync(device)
            start = time.perf_counter()
            if i == 0:  # the warm-up step: its saved tensors are counted
                with SavedTensorMeter(exclude=params) as meter:
                    losses.append(loss_and_backward(module, x))
                act_mib = meter.bytes / MIB
            else:
                losses.append(loss_and_backward(module, x))
            torch.nn.utils.clip_grad_norm_(params, s.dkef_clip)
            opt.step()
            sync(device)
            if i:
                times.append(time.perf_counter() - start)
    finally:
        counter.remove()
    tail = losses[-max(1, steps // 10):]
    return {
        "steps": steps, "act_mib": act_mib, "time_ms": 1e3 * statistics.median(times) if times else None,
        "repeats": len(times), "solver_iters": statistics.mean(counter.counts) if counter.counts else None,
        "first_loss": losses[0], "final_loss": statistics.mean(tail),
    }


def evaluate(module: DKEFModule, data: DKEFData, s: Settings, device: torch.device) -> dict:
    """Alpha refreshed on training points, then test log-likelihood, log Z and (highdim) the true quantities."""
    net, steps = module.net, steps_for(s, data.dim)
    points = data.datamodule.train_subset(min(s.dkef_alpha_points, len(data.train)),
                                          torch.Generator().manual_seed(steps)).to(device)
    refresh_alpha(module, points, s.dkef_alpha_chunk)
    generator = torch.Generator(device=device).manual_seed(12345)
    n = log_z_samples(s, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log_z, stderr = net.log_partition(n_samples=n, chunk=s.dkef_log_z_chunk, proposal_std=s.dkef_proposal_std,
                                          generator=generator)
    row = {"log_z": log_z, "log_z_stderr": stderr, "ess": n / (1 + stderr**2 * (n - 1)),
           "log_z_warning": any("log_partition" in str(w.message) for w in caught)}
    with torch.no_grad():
        row["test_ll"] = (net.log_density(data.test) - log_z).mean().item()
        # the base q0 = N(0, q0_std^2 I) alone, normalised exactly: what the kernel part has to improve on
        var = net.q0_std**2
        sq_norm = data.test.pow(2).sum(1).mean().item()
        row["base_ll"] = -0.5 * data.dim * math.log(2 * math.pi * var) - sq_norm / (2 * var)
        row["kernel_median"] = net.kernel(data.test).median().item()
    true_score = data.datamodule.true_score(data.test.cpu())
    if true_score is not None:
        with torch.no_grad(), deq_backward(net, "unroll"):  # the layer as solved to tolerance (see DKEFModule)
            score = net.score(data.test)
        row["fisher"] = 0.5 * (score - true_score.to(device)).pow(2).sum(1).mean().item()
        row["true_ll"] = data.datamodule.true_log_prob(data.test.cpu()).mean().item()
        row["base_fisher"] = 0.5 * (1 - 1 / var) ** 2 * sq_norm  # q0 alone: score -x / var
    return row


def dkef_row(s: Settings, label: str, kind: str, data: DKEFData, device: torch.device) -> dict:
    net = build_dkef(s, kind, data.dim)
    net.init_centres(data.train.cpu(), torch.Generator().manual_seed(0))
    module = make_module(net.to(device), s)
    row = {"data": data.name, "dim": data.dim, "model": label, "params": parameter_count(net)}
    row |= train(module, data, s, device)
    row |= evaluate(module, data, s, device)
    log(f"dkef: {data.name} D={data.dim} {label}: {row['act_mib']:.1f} MiB, "
        f"{fmt_value(row['time_ms'], '.0f')} ms/step, loss {row['first_loss']:.3g} -> {row['final_loss']:.3g}, "
        f"test LL {row['test_ll']:.3f} "
        f"(log Z stderr {row['log_z_stderr']:.2g}, ESS {row['ess']:.0f})")
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


def _default_init_kernel(s: Settings, data: DKEFData) -> float:
    """Median kernel value on the test points at the fixed widths ``10^l`` (before any training)."""
    net = build_dkef(s, "shallow", data.dim, bandwidth_init="fixed")
    net.init_centres(data.train.cpu(), torch.Generator().manual_seed(0))
    with torch.no_grad():
        return net.kernel(data.test.cpu()).median().item()


def dkef(s: Settings, device: torch.device) -> Table:
    table = Table("dkef", "5. DKEF feature networks: explicit shallow, explicit deep, DEQ (two-stage SSM-VR)", [
        Column("data", "data"), Column("dim", "D"), Column("model", "feature net"), Column("params", "parameters", ","),
        Column("act_mib", "activation memory (MiB)", ".2f"), Column("time_ms", "step time (ms)", ".0f"),
        Column("steps", "steps"), Column("solver_iters", "Picard iters / solve", ".1f"),
        Column("first_loss", "loss step 1", ".4g"), Column("final_loss", "loss, last 10%", ".4g"),
        Column("test_ll", "test log-lik.", ".3f"), Column("log_z_stderr", "log Z stderr", ".2g"),
        Column("ess", "IS ESS", ".0f"), Column("true_ll", "true test log-lik.", ".3f"),
        Column("fisher", "Fisher div.", ".4g"), Column("kernel_median", "median k (test)", ".2g"),
    ])
    datasets, skipped = load_datasets(s, device)
    default_kernel, table.meta["ratios_deq_over_deep"] = {}, {}
    for data in datasets:
        key = f"{data.name} {data.dim}"
        rows = {label: dkef_row(s, label, kind, data, device) for label, kind in FEATURE_NETS}
        table.meta["ratios_deq_over_deep"][key] = ratio = ratios(rows)
        table.rows += [*rows.values(), _ratio_row(rows, ratio)]
        default_kernel[key] = _default_init_kernel(s, data)
    table.meta["median_kernel_at_default_init"] = default_kernel
    table.notes += skipped + _notes(s, table.rows, default_kernel) + findings(table.rows)
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


def _notes(s: Settings, rows: list[dict], default_kernel: dict[str, float]) -> list[str]:
    steps = f"{s.dkef_steps} steps" + "".join(f" ({n} at D = {d})" for d, n in s.dkef_steps_by_dim)
    init = ", ".join(f"{k}: {v:.1e}" for k, v in default_kernel.items())
    unreliable = [f"{r['data']} {r['dim']} {r['model']}" for r in rows if r.get("log_z_warning")]
    return [
        f"DKEF with {s.dkef_n_centres} centres, feature width {s.dkef_hidden}, three kernels; feature nets: explicit "
        f"shallow (3 Linear layers), explicit deep ({s.dkef_deep_layers} Linear layers) or DEQ (`DEQ(solver="
        f"{s.dkef_solver!r}, tol={s.dkef_tol:g}, max_iter={s.dkef_max_iter}, backward='phantom', phantom_steps="
        f"{s.dkef_phantom_steps})`, cold start), each plus a linear skip. Loss `{s.dkef_loss}`; the step is "
        "`DKEFModule.compute_loss` (alpha solved on the first half of the batch with create_graph=True, the loss on "
        f"the second half) + backward + clip at norm {s.dkef_clip:g} + Adam (lr {s.dkef_lr:g}); batch {s.dkef_batch}, "
        f"{steps}, the same batches, projections and seed ({s.seed}) for the three nets.",
        "Activation memory: the first (warm-up) step's storages saved for backward (`SavedTensorMeter`, parameters "
        "excluded, with every saved tensor pinned until the step ends: otherwise a storage freed within the step can "
        "hand its address to a later one, which then goes uncounted, by up to ~2% from run to run). "
        "Step time: median wall clock of the remaining steps (clip and Adam included); Picard iters: mean "
        "solver iterations per DEQ forward during training.",
        f"Evaluation: alpha refreshed once on {s.dkef_alpha_points} training points after the last step (identical "
        "to refreshing after every step, as the Lightning module does: the training step never reads the stored "
        f"alpha); log Z by importance sampling from N(0, {s.dkef_proposal_std:g}^2 I), "
        f"{s.dkef_log_z_samples_redwine:,} draws on RedWine, {s.dkef_log_z_samples:,} on highdim; test log-lik. = "
        "mean over the test split; IS ESS = effective sample size, from the stderr. The stderr "
        "only measures the spread of the weights among the draws: in high dimension the proposal can miss the mass "
        "of the model altogether, so a small stderr does not prove an accurate log Z. Estimates flagged unreliable "
        "by `log_partition` (ESS < 100 or stderr > 0.1): " + ("; ".join(unreliable) if unreliable else "none") + ".",
        "highdim: N(0, I) data (4860 train / 600 test rows); true test log-lik. is that of N(0, I) on the same "
        "points, Fisher div. = 0.5 E||s_model(x) + x||^2 over them (DEQ score through the unrolled solve).",
        f"Kernel bandwidth init: `{s.dkef_bandwidth_init}`"
        + (" (DKEF's default: l_j shifted by log10(median squared feature distance / 2) between training points "
           f"and centres). Median k on the test points at the fixed widths (`bandwidth_init: fixed`, l = 0, 0.52, "
           f"0.52), shallow net: {init}; a k near 0 means kernels that vanish (no gradient reaches the features), "
           "so that DKEF stays at its base q0: the reason for the median init."
           if s.dkef_bandwidth_init == "median" else f". Median k on the test points at this init: {init}."),
    ]
