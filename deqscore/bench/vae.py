"""Benchmark section ``vae``: the implicit-encoder VAE with an explicit or a DEQ score network, for binarised MNIST
(MLP) and 64x64 RGB images (conv): parameters, activation memory and time of the score network's SSM-VR step, and
the time of one whole training iteration (``score_updates`` score steps and the encoder/decoder surrogate step).

The score network is where the DEQ matters: its SSM-VR loss differentiates the network's output w.r.t. z and then the
parameters, so an explicit network keeps every layer's activations twice over; the ratio rows divide each DEQ row by
the explicit row of the same architecture.
"""

from __future__ import annotations

from functools import partial

import torch

from ..deq import DEQ
from ..metrics import parameter_count
from ..models import ImplicitVAE
from .measure import log, measure_step, timed
from .report import Column, Table, ratio_cells
from .settings import Settings

KINDS = ("explicit", "deq")


def build_vae(s: Settings, arch: str, score: str) -> ImplicitVAE:
    """A freshly initialised implicit-encoder VAE (seed ``s.seed``) at the benchmark's size; the DEQ's options are
    those of ``configs/vae/deq_{mnist,celeba}.yaml``."""
    torch.manual_seed(s.seed)
    mlp = arch == "mlp"
    deq = partial(DEQ, solver="picard", max_iter=s.vae_max_iter, tol=s.vae_tol, backward="phantom",
                  phantom_steps=2 if mlp else 1, injection_prestep=not mlp, warn_on_nonconvergence=False)
    if mlp:
        return ImplicitVAE(dim=784, arch="mlp", z_dim=8, eps_dim=8, hidden=s.vae_hidden, score=score, deq=deq,
                           norm_scale=2.0)
    side = s.vae_side
    return ImplicitVAE(dim=3 * side * side, channels=3, arch="conv", z_dim=64, eps_dim=32, nef=s.vae_nef,
                       score=score, deq=deq, norm_scale=10.0)


def _inputs(s: Settings, vae: ImplicitVAE, device: torch.device) -> torch.Tensor:
    """Seeded random data of the VAE's shape: binary pixels (MLP) or grey levels in [0, 1] (conv)."""
    gen = torch.Generator().manual_seed(s.seed)
    mlp = vae.arch == "mlp"
    x = torch.rand(s.vae_batch if mlp else s.vae_conv_batch, vae.dim, generator=gen)
    return (x.bernoulli(generator=gen) if mlp else x).to(device)


def _row(s: Settings, arch: str, score: str, device: torch.device) -> dict:
    vae = build_vae(s, arch, score).to(device)
    x = _inputs(s, vae, device)

    def score_step() -> None:
        torch.manual_seed(s.seed)  # the same encoder noise and projections in every timed step
        vae.score_loss(x).mean().backward()

    def iteration() -> None:
        torch.manual_seed(s.seed)
        for _ in range(s.vae_score_updates):
            vae.score_loss(x).mean().backward()
        vae.surrogate(x).mean().backward()
        vae.zero_grad(set_to_none=True)

    res = measure_step(score_step, vae.score, device, s)
    _, iteration_ms, _ = timed(iteration, device, s)
    deqs = [m for m in vae.score.modules() if isinstance(m, DEQ)]
    label = f"{'MNIST MLP' if arch == 'mlp' else f'{s.vae_side}x{s.vae_side} conv'}, {score}"
    log(f"vae: {label}: {res.act_mib:.1f} MiB, score step {res.time_ms:.0f} ms, iteration {iteration_ms:.0f} ms")
    return {"model": label, "score_params": parameter_count(vae.score), "params": parameter_count(vae), **vars(res),
            "iteration_ms": iteration_ms, "solver_iters": deqs[0].stats.nstep if deqs else None}


def _ratio(explicit: dict, deq: dict, arch: str) -> dict:
    keys = ("score_params", "params", "act_mib", "peak_mib", "time_ms", "iteration_ms")
    return {"model": f"ratio DEQ / explicit, {arch}", **ratio_cells(deq, explicit, keys)}


def vae(s: Settings, device: torch.device) -> Table:
    table = Table("vae", "7. VAE with an implicit encoder: explicit vs DEQ score network (one training step)", [
        Column("model", "data, score network"), Column("score_params", "score-net parameters", ","),
        Column("params", "VAE parameters", ","), Column("act_mib", "score step: activation memory (MiB)", ".2f"),
        Column("peak_mib", "score step: CUDA peak (MiB)", ".1f"), Column("time_ms", "score step (ms)", ".1f"),
        Column("iteration_ms", "training iteration (ms)", ".1f"), Column("solver_iters", "DEQ solver iters", "d"),
    ])
    for arch in ("mlp", "conv"):
        explicit, deq = (_row(s, arch, kind, device) for kind in KINDS)
        table.rows += [explicit, deq, _ratio(explicit, deq, "MNIST MLP" if arch == "mlp" else "conv")]
    table.notes += [
        f"Batch {s.vae_batch} (MLP), {s.vae_conv_batch} (conv), float32, seeded random data (binary 784-pixel "
        f"images; {s.vae_side}x{s.vae_side}x3 grey levels). MLP: hidden {s.vae_hidden}, z 8 "
        f"(configs/vae/*_mnist.yaml); conv: nef {s.vae_nef}, z 64 (configs/vae/*_celeba.yaml). DEQ score "
        f"networks: Picard, tol {s.vae_tol:g}, max_iter {s.vae_max_iter}, phantom gradients (2 steps for the MLP; "
        "the injection pre-step and 1 step for the conv net), cold start.",
        "Score step: the score network's SSM-VR loss (one Gaussian projection, variance reduction) on encoder "
        "samples, forward and backward, no optimiser update; activation memory: tensors autograd saves for its "
        f"backward (parameters excluded). Training iteration: {s.vae_score_updates} score steps and the "
        "encoder/decoder surrogate step, forward and backward.",
    ]
    return table
