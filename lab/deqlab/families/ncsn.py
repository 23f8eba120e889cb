"""Benchmark section ``ncsn``: the NCSN bodies of ``configs/ncsn/*_cifar10.yaml`` at 32x32 (shallow explicit, DEQ
with phantom and with IFT gradients, full NCSNv2): parameters, activation memory and time of one training step of
annealed DSM (and SSM-VR, which a DEQ can only take with phantom gradients); and the time of one network evaluation
inside annealed Langevin sampling, per image.

The paper's claim is that the DEQ body needs far less memory than NCSNv2 at comparable quality: the ratio rows divide
each body's figures by NCSNv2's.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from deqscore.deq import DEQ
from deqscore.lightning import NCSNModule
from deqscore.metrics import parameter_count

from ..configs import Options, Variant, build, options_text
from ..measure import log, measure_step, timed
from ..report import Column, Table, ratio_cells
from ..settings import Settings
from ..study.core import Variant as StudyVariant
from ..study.evaluation import sample_quality, scored_weights, test_metrics

BODIES = (
    Variant("shallow explicit", "configs/ncsn/shallow_cifar10.yaml"),
    Variant("DEQ, phantom", "configs/ncsn/deq_cifar10.yaml"),
    Variant("DEQ, IFT", "configs/ncsn/deq_cifar10.yaml", {"net.deq.backward": "ift"}),
    Variant("DEQ reference (full resolution), phantom", "configs/ncsn/deq_cifar10_reference.yaml"),
    Variant("NCSNv2", "configs/ncsn/ncsnv2_cifar10.yaml"),
)
LOSSES = ("annealed_dsm", "annealed_ssm_vr")  # the configs' SSM-VR and NCSNv2's own DSM
# The benchmark's options, the one place they are stated. The configs' Picard solve to an absolute 1e-5 over the
# whole batch (the reference's) runs to its iteration cap at this size, which multiplies the forward cost (not the
# memory); a relative tolerance with Anderson keeps CPU rows affordable.
DEQ_OPTIONS: Options = {"net.deq.solver": "anderson", "net.deq.tol": 1e-3, "net.deq.stop_mode": "rel",
                        "net.deq.max_iter": 40, "net.deq.warn_on_nonconvergence": False}
SIZES: dict[str, Options] = {
    "full": {"net.dim": 3 * 32 * 32},  # CIFAR-10's images, the configs' data
    "quick": {"net.dim": 3 * 8 * 8, "net.ngf": 4, "n_levels": 10},
}
BATCH = {"full": 16, "quick": 4}  # training step and sampling (memory is linear in it; CPU rows stay affordable)


def options(s: Settings, body: Variant, loss: str | None = None) -> dict[str, object]:
    """The options a row is built with: the body's, the mode's sizes, (DEQ) the solver's, and the loss."""
    deq = {k: v for k, v in DEQ_OPTIONS.items() if k not in body.options} if "deq" in body.config else {}
    return {**body.options, **SIZES[s.mode], **deq, **({"loss": loss} if loss else {})}


def build_ncsn(s: Settings, body: Variant, loss: str | None = None) -> NCSNModule:
    """The module of ``body``'s config at the benchmark's options."""
    return cast(NCSNModule, build(body.config, options(s, body, loss)))


def _step_row(s: Settings, body: Variant, loss: str, x: torch.Tensor, device: torch.device) -> dict:
    module = build_ncsn(s, body, loss).to(device).train()

    def step_loss() -> torch.Tensor:
        torch.manual_seed(s.seed)  # the same levels, noise and projections in every timed step
        return module.loss_terms(x)["loss"]

    res = measure_step(step_loss, module, device, s)
    deqs = [m for m in module.modules() if isinstance(m, DEQ)]
    row = {"model": body.label, "loss": loss, "params": parameter_count(module), **vars(res),
           "solver_iters": deqs[0].stats.nstep if deqs else None}
    log(f"ncsn: {body.label}, {loss}: {res.act_mib:.0f} MiB, {res.time_ms:.0f} ms/step")
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


def _langevin_row(s: Settings, body: Variant, device: torch.device) -> dict:
    """ms per network evaluation per image in sampling (eval mode, no graph, DEQ warm-started along the chain, as
    ``NCSNModule.sample`` does), and the seconds per image this gives for the config's schedule and sampler."""
    module = build_ncsn(s, body).to(device).eval()
    net, sigmas = module.net, module.sigmas
    deqs = [m for m in net.modules() if isinstance(m, DEQ)]
    for d in deqs:
        d.warm_start = True
    x = torch.rand(BATCH[s.mode], net.dim, device=device)
    level = torch.full((x.shape[0],), float(sigmas[len(sigmas) // 2]), device=device)
    with torch.no_grad():
        _, ms, _ = timed(lambda: net(x + 1e-3 * torch.randn_like(x), level), device, s)
    evals = len(sigmas) * module.sampler.n_steps_each + int(module.sampler.final_denoise)
    per_image = ms / x.shape[0]
    return {"model": body.label, "eval_ms_per_image": per_image, "sample_s_per_image": per_image * evals / 1e3,
            "evaluations": evals, "solver_iters": deqs[0].stats.nstep if deqs else None}


def section(s: Settings, device: torch.device) -> Table:
    table = Table("ncsn", "6. NCSN bodies at 32x32: one training step, sampling cost", [
        Column("model", "body"), Column("loss", "loss"), Column("params", "parameters", ","),
        Column("act_mib", "activation memory (MiB)", ".1f"), Column("peak_mib", "CUDA peak (MiB)", ".1f"),
        Column("time_ms", "step time (ms)", ".0f"), Column("solver_iters", "DEQ solver iters", "d"),
        Column("eval_ms_per_image", "sampling: ms per evaluation per image", ".2f"),
        Column("sample_s_per_image", "sampling: s per image (schedule)", ".2f"),
    ])
    gen = torch.Generator().manual_seed(s.seed)
    x = torch.rand(BATCH[s.mode], int(SIZES[s.mode]["net.dim"]), generator=gen).to(device)
    for loss in LOSSES:
        rows = [_step_row(s, body, loss, x, device) for body in BODIES
                if not (body.options.get("net.deq.backward") == "ift" and loss == "annealed_ssm_vr")]  # refused
        table.rows += rows + _ratio_rows(rows, loss)
    for body in BODIES:
        if body.options.get("net.deq.backward") != "ift":  # sampling takes no gradient: IFT and phantom alike
            table.rows.append(_langevin_row(s, body, device))
    reference = build_ncsn(s, BODIES[0])
    sigmas = reference.sigmas
    table.meta["options"] = {b.label: options(s, b) for b in BODIES} | {"batch": BATCH[s.mode]}
    table.notes += [
        f"Each body is its config's module (`build_module` on `model:`), with the options: "
        f"{'; '.join(f'{b.label}: {options_text(options(s, b))}' for b in BODIES)}; the loss of each row as "
        f"given. Random images in [0, 1], batch {BATCH[s.mode]}, float32; the configs' noise schedule (the "
        f"module's sigmas: {sigmas[0]:g} -> {sigmas[-1]:g} over {len(sigmas)} levels). IFT is shown for DSM only "
        "(it is refused for SSM-VR).",
        "One training step = `module.loss_terms(x)['loss']` and its backward (no optimiser update), the same draws "
        "each time. Activation memory: `loss_step_bytes`, the storages autograd saves in the forward and "
        "backward, parameters excluded (the figure training logs); the ratio rows divide by NCSNv2's row of the "
        "same loss.",
        f"Sampling: one network evaluation on a batch of {BATCH[s.mode]} in eval mode without a graph (DEQ "
        "warm-started from the previous evaluation, as NCSNModule.sample does), per image; s per image multiplies "
        f"it by the config's sampler: {len(sigmas)} levels x {reference.sampler.n_steps_each} steps + the final "
        "denoising evaluation.",
    ]
    return table


def evaluate(run_dir: Path, checkpoint: Path, variant: StudyVariant, seed: int, evaluation: dict) -> dict:
    """The study's evaluation of a trained NCSN run (see :mod:`deqlab.study.evaluation`): KID and FID@N of its
    samples and, where the protocol asks for it (``held_out``), the denoising loss of every test image at every
    noise level with fixed noise (``train.py test`` with ``test_every_level``), its standard error over the images
    and its value per level."""
    metrics = sample_quality(run_dir, checkpoint, seed, evaluation)
    if evaluation.get("held_out"):
        metrics |= held_out(run_dir, checkpoint, evaluation)
    return metrics


def held_out(run_dir: Path, checkpoint: Path, evaluation: dict) -> dict:
    """``dsm_every_level`` (the mean over test images and levels), its standard error over the ``test_images``
    and ``dsm_per_level`` (largest sigma first, up to ``levels``), from ``train.py test``; the trust figures of a
    DEQ beside them."""
    keys = ("dsm_every_level", "dsm_every_level_sq", *(f"dsm_level_{i}" for i in range(evaluation["levels"])))
    logged = test_metrics(run_dir, checkpoint, ["--model.init_args.test_every_level=true",
                                                *scored_weights(evaluation)], keys)
    mean, square, n = logged.pop("dsm_every_level"), logged.pop("dsm_every_level_sq"), evaluation["test_images"]
    per_level = [logged.pop(key) for i in range(evaluation["levels"]) if (key := f"dsm_level_{i}") in logged]
    return {"dsm_every_level": mean, "dsm_every_level_se": max(square - mean**2, 0.0) ** 0.5 / n ** 0.5,
            "dsm_per_level": per_level, **logged}
