"""Benchmark section ``vae``: the implicit-encoder VAEs of ``configs/vae/{explicit,deq}_{mnist,celeba}.yaml``, with an
explicit or a DEQ score network, for binarised MNIST (MLP) and 64x64 RGB images (conv): parameters, activation
memory and time of the score network's SSM-VR step, and the time of one whole training iteration (``score_updates``
score steps and the encoder/decoder surrogate step).

The score network is where the DEQ matters: its SSM-VR loss differentiates the network's output w.r.t. z and then the
parameters, so an explicit network keeps every layer's activations twice over; the ratio rows divide each DEQ row by
the explicit row of the same architecture.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from deqscore.deq import DEQ
from deqscore.lightning import VAEModule
from deqscore.metrics import parameter_count

from ..configs import Options, Variant, build, options_text
from ..measure import log, measure_step, timed
from ..report import Column, Table, ratio_cells
from ..settings import Settings
from ..study.core import Variant as StudyVariant
from ..study.evaluation import GRID, draw_samples, test_metrics

ARCHS = {  # (explicit, DEQ, ...) score networks of each architecture; ratio rows divide each DEQ by the explicit
    "MNIST MLP": (Variant("explicit", "configs/vae/explicit_mnist.yaml"), Variant("deq", "configs/vae/deq_mnist.yaml")),
    "conv": (Variant("explicit", "configs/vae/explicit_celeba.yaml"), Variant("deq", "configs/vae/deq_celeba.yaml"),
             Variant("deq reference", "configs/vae/deq_celeba_reference.yaml")),
}
# The benchmark's options and batches, the one place they are stated. The conv batch is 16: the DEQ's
# full-resolution solve makes CPU rows slow at the configs' 128.
SIZES: dict[str, dict[str, Options]] = {
    "full": {"MNIST MLP": {"net.dim": 784}, "conv": {"net.dim": 3 * 64 * 64}},  # the configs' data
    "quick": {"MNIST MLP": {"net.dim": 784, "net.hidden": 16},
              "conv": {"net.dim": 3 * 16 * 16, "net.nef": 4}},
}
DEQ_OPTIONS: dict[str, Options] = {"full": {"net.deq.warn_on_nonconvergence": False},
                                   "quick": {"net.deq.warn_on_nonconvergence": False, "net.deq.max_iter": 20}}
BATCH = {"full": {"MNIST MLP": 128, "conv": 16}, "quick": {"MNIST MLP": 4, "conv": 4}}


def options(s: Settings, arch: str, variant: Variant) -> dict[str, object]:
    """The options a row is built with: the mode's sizes and (DEQ) the solver's."""
    return {**SIZES[s.mode][arch], **(DEQ_OPTIONS[s.mode] if "deq" in variant.label else {})}


def build_vae(s: Settings, arch: str, variant: Variant) -> VAEModule:
    """The module of ``variant``'s config at the benchmark's options."""
    return cast(VAEModule, build(variant.config, options(s, arch, variant)))


def _inputs(s: Settings, module: VAEModule, arch: str, device: torch.device) -> torch.Tensor:
    """Seeded random data of the VAE's shape, as the module prepares it: binary pixels (MNIST) or grey levels."""
    gen = torch.Generator().manual_seed(s.seed)
    x = torch.rand(BATCH[s.mode][arch], module.net.dim, generator=gen)
    return (x.bernoulli(generator=gen) if module.binarize else x).to(device)


def _row(s: Settings, arch: str, variant: Variant, device: torch.device) -> dict:
    module = build_vae(s, arch, variant).to(device).train()
    vae, x = module.net, _inputs(s, module, arch, device)

    def score_loss() -> torch.Tensor:
        torch.manual_seed(s.seed)  # the same encoder noise and projections in every timed step
        return vae.score_loss(x).mean()

    def iteration() -> None:
        torch.manual_seed(s.seed)
        for _ in range(module.score_updates):
            vae.score_loss(x).mean().backward()
        vae.surrogate(x).mean().backward()
        vae.zero_grad(set_to_none=True)

    res = measure_step(score_loss, module, device, s)
    _, iteration_ms, _ = timed(iteration, device, s)
    deqs = [m for m in vae.score.modules() if isinstance(m, DEQ)]
    label = f"{arch}, {variant.label}"
    log(f"vae: {label}: {res.act_mib:.1f} MiB, score step {res.time_ms:.0f} ms, iteration {iteration_ms:.0f} ms")
    return {"model": label, "config": variant.config, "score_params": parameter_count(vae.score),
            "params": parameter_count(module), **vars(res), "iteration_ms": iteration_ms,
            "solver_iters": deqs[0].stats.nstep if deqs else None}


def _ratio(explicit: dict, deq: dict, label: str, arch: str) -> dict:
    keys = ("score_params", "params", "act_mib", "peak_mib", "time_ms", "iteration_ms")
    return {"model": f"ratio {label} / explicit, {arch}", **ratio_cells(deq, explicit, keys)}


def section(s: Settings, device: torch.device) -> Table:
    table = Table("vae", "7. VAE with an implicit encoder: explicit vs DEQ score network (one training step)", [
        Column("model", "data, score network"), Column("score_params", "score-net parameters", ","),
        Column("params", "VAE parameters", ","), Column("act_mib", "score step: activation memory (MiB)", ".2f"),
        Column("peak_mib", "score step: CUDA peak (MiB)", ".1f"), Column("time_ms", "score step (ms)", ".1f"),
        Column("iteration_ms", "training iteration (ms)", ".1f"), Column("solver_iters", "DEQ solver iters", "d"),
    ])
    for arch, (explicit_variant, *deq_variants) in ARCHS.items():
        explicit = _row(s, arch, explicit_variant, device)
        deqs = [(v.label, _row(s, arch, v, device)) for v in deq_variants]
        table.rows += [explicit, *(row for _, row in deqs)]
        table.rows += [_ratio(explicit, row, label, arch) for label, row in deqs]
    table.meta["options"] = {f"{arch}, {v.label}": options(s, arch, v) for arch, vs in ARCHS.items() for v in vs}
    table.meta["batch"] = BATCH[s.mode]
    table.notes += [
        "Each VAE is its config's module (`build_module` on `model:`), with the options: "
        + "; ".join(f"{v.config}: {options_text(options(s, arch, v))}" for arch, vs in ARCHS.items() for v in vs)
        + f". Batch {BATCH[s.mode]['MNIST MLP']} (MNIST MLP), {BATCH[s.mode]['conv']} (conv), float32, seeded "
        "random data (binary pixels; grey levels).",
        "Score step: the score network's SSM-VR loss (`net.score_loss`) on encoder samples, forward and backward, "
        "no optimiser update; activation memory: `loss_step_bytes`, the storages autograd saves in the "
        "forward and backward, parameters excluded. Training iteration: the config's score_updates score steps and "
        "the encoder/decoder surrogate step, forward and backward.",
    ]
    return table


def evaluate(run_dir: Path, checkpoint: Path, variant: StudyVariant, seed: int, evaluation: dict) -> dict:
    """The study's evaluation of a trained VAE run (see :mod:`deqlab.study.evaluation`)."""
    options = ["--model.init_args.ais_batches=1", f"--data.init_args.eval_batch_size={evaluation['ais_images']}",
               f"--model.init_args.ais_steps={evaluation['ais_steps']}",
               f"--model.init_args.ais_chains={evaluation['ais_chains']}"]
    metrics = test_metrics(run_dir, checkpoint, options, ("ais_log_likelihood", "loss"))
    loss = metrics.pop("loss")
    if variant.role == "classical":  # the Gaussian encoder's loss is the negative ELBO; the implicit one has none
        metrics["elbo"] = -loss
    draw_samples(checkpoint, run_dir / "samples", GRID, seed)
    return metrics
