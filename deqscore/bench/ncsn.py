"""Benchmark section ``ncsn``: NCSN bodies at 32x32 (shallow explicit, DEQ with phantom and with IFT gradients,
full NCSNv2): parameters, activation memory and time of one training step of annealed DSM (and SSM-VR, which a DEQ
can only take with phantom gradients); the time of one network evaluation inside annealed Langevin sampling, per
image; and the throughput of the FID Inception features.

The paper's claim is that the DEQ body needs far less memory than NCSNv2 at comparable quality: the ratio rows divide
each body's figures by NCSNv2's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ..deq import DEQ
from ..losses import annealed_dsm, annealed_ssm_vr
from ..metrics import parameter_count
from ..models import NCSN
from .measure import log, measure_step, timed
from .report import Column, Table, ratio_cells
from .settings import Settings

# label, body, DEQ backward (None: explicit)
BODIES = (("shallow explicit", "shallow", None), ("DEQ, phantom", "deq", "phantom"), ("DEQ, IFT", "deq", "ift"),
          ("NCSNv2", "ncsnv2", None))
LOSSES: dict[str, Callable] = {"annealed_dsm": annealed_dsm, "annealed_ssm_vr": annealed_ssm_vr}


def config_sigmas(s: Settings) -> torch.Tensor:
    """The noise levels of ``s.ncsn_config``, as NCSNModule builds them from it (``s.ncsn_levels`` levels when
    set, for a smaller run): the schedule has one definition, the module's."""
    import yaml

    from ..lightning import build_module

    model = yaml.safe_load((Path(__file__).resolve().parents[2] / s.ncsn_config).read_text())["model"]
    init = {k: v for k, v in model["init_args"].items() if k in ("schedule", "sigma_max", "sigma_min", "n_levels")}
    if s.ncsn_levels is not None:
        init["n_levels"] = s.ncsn_levels
    net = {"class_path": "deqscore.models.NCSN", "init_args": {"dim": 3 * 8 * 8, "ngf": 2, "body": "shallow"}}
    return build_module({"class_path": model["class_path"], "init_args": {**init, "net": net}}).sigmas


def build_ncsn(s: Settings, body: str, backward: str | None) -> NCSN:
    """A freshly initialised NCSN (seed ``s.seed``) at the benchmark's size; the DEQ's pre-step and phantom step
    are those of the CIFAR-10 config, its solver the benchmark's."""
    torch.manual_seed(s.seed)
    deq = partial(DEQ, solver=s.ncsn_solver, tol=s.ncsn_tol, stop_mode=s.ncsn_stop_mode, max_iter=s.ncsn_max_iter,
                  backward=backward or "phantom", injection_prestep=True, phantom_steps=1,
                  warn_on_nonconvergence=False)
    return NCSN(dim=3 * s.ncsn_side**2, channels=3, ngf=s.ncsn_ngf, body=body, deq=deq)


def _step_row(s: Settings, label: str, body: str, backward: str | None, loss: str, x: torch.Tensor,
              sigmas: torch.Tensor, device: torch.device) -> dict:
    net = build_ncsn(s, body, backward).to(device)

    def step() -> None:
        torch.manual_seed(s.seed)  # the same levels, noise and projections in every timed step
        LOSSES[loss](net, x, sigmas).mean().backward()

    res = measure_step(step, net, device, s)
    deqs = [m for m in net.modules() if isinstance(m, DEQ)]
    row = {"model": label, "loss": loss, "params": parameter_count(net), **vars(res),
           "solver_iters": deqs[0].stats.nstep if deqs else None}
    log(f"ncsn: {label}, {loss}: {res.act_mib:.0f} MiB, {res.time_ms:.0f} ms/step")
    return row


def _ratio_rows(rows: list[dict], loss: str) -> list[dict]:
    """Each body's parameters, memory and time over NCSNv2's, for one loss."""
    ref = next((r for r in rows if r["model"] == "NCSNv2" and r["loss"] == loss), None)
    if ref is None:
        return []
    out = []
    for r in rows:
        if r["loss"] == loss and r is not ref:
            ratio = ratio_cells(r, ref, ("params", "act_mib", "peak_mib", "time_ms"))
            out.append({"model": f"ratio {r['model']} / NCSNv2", "loss": loss, **ratio})
    return out


def _langevin_row(s: Settings, label: str, body: str, sigmas: torch.Tensor, device: torch.device) -> dict:
    """ms per network evaluation per image in sampling (eval mode, no graph, DEQ warm-started along the chain),
    and the seconds per image this gives for the CIFAR-10 schedule's evaluations."""
    net = build_ncsn(s, body, "phantom").to(device).eval()
    deqs = [m for m in net.modules() if isinstance(m, DEQ)]
    for d in deqs:
        d.warm_start = True
    x = torch.rand(s.ncsn_sample_batch, net.dim, device=device)
    level = torch.full((x.shape[0],), float(sigmas[len(sigmas) // 2]), device=device)
    with torch.no_grad():
        _, ms, _ = timed(lambda: net(x + 1e-3 * torch.randn_like(x), level), device, s)
    evals = len(sigmas) * s.ncsn_langevin_steps + 1
    per_image = ms / x.shape[0]
    return {"model": label, "eval_ms_per_image": per_image, "sample_s_per_image": per_image * evals / 1e3,
            "solver_iters": deqs[0].stats.nstep if deqs else None}


def ncsn(s: Settings, device: torch.device) -> Table:
    table = Table("ncsn", "6. NCSN bodies at 32x32: one training step, sampling cost", [
        Column("model", "body"), Column("loss", "loss"), Column("params", "parameters", ","),
        Column("act_mib", "activation memory (MiB)", ".1f"), Column("peak_mib", "CUDA peak (MiB)", ".1f"),
        Column("time_ms", "step time (ms)", ".0f"), Column("solver_iters", "DEQ solver iters", "d"),
        Column("eval_ms_per_image", "sampling: ms per evaluation per image", ".2f"),
        Column("sample_s_per_image", "sampling: s per image (schedule)", ".2f"),
    ])
    sigmas = config_sigmas(s)
    gen = torch.Generator().manual_seed(s.seed)
    x = torch.rand(s.ncsn_batch, 3 * s.ncsn_side**2, generator=gen).to(device)
    for loss in s.ncsn_losses:
        rows = [_step_row(s, label, body, backward, loss, x, sigmas, device) for label, body, backward in BODIES
                if not (backward == "ift" and loss == "annealed_ssm_vr")]  # refused: wrong gradients
        table.rows += rows + _ratio_rows(rows, loss)
    for label, body, backward in BODIES:
        if backward != "ift":  # sampling takes no gradient: IFT and phantom run the same solve
            table.rows.append(_langevin_row(s, label, body, sigmas, device))
    table.notes += [
        f"Random images in [0, 1], batch {s.ncsn_batch}, {s.ncsn_side}x{s.ncsn_side}x3, ngf {s.ncsn_ngf}, float32; "
        f"noise schedule of {s.ncsn_config}: {float(sigmas[0]):g} -> {float(sigmas[-1]):g} over {len(sigmas)} "
        "levels. "
        f"One training step = the annealed loss's forward and backward (no optimiser update), the same draws each "
        f"time. DEQ: {s.ncsn_solver}, tol {s.ncsn_tol:g} ({s.ncsn_stop_mode}), max_iter {s.ncsn_max_iter}, "
        "injection pre-step and one phantom step (the CIFAR-10 config's gradient), cold start; IFT is shown for DSM "
        "only (it is refused for SSM-VR). The config's Picard solve to an absolute 1e-5 over the whole batch (the "
        "reference's) runs to its iteration cap at this size, which multiplies the forward cost, not the memory.",
        "Activation memory: bytes of the tensors autograd saves for the backward of one step (parameters "
        "excluded); the ratio rows divide by NCSNv2's row of the same loss.",
        f"Sampling: one network evaluation on a batch of {s.ncsn_sample_batch} in eval mode without a graph (DEQ "
        f"warm-started from the previous evaluation, as NCSNModule.sample does), per image; s per image multiplies it "
        f"by the schedule's {len(sigmas)} levels x {s.ncsn_langevin_steps} steps + 1 denoising evaluation.",
    ]
    return table
