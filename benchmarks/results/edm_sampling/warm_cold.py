"""Warm against cold DEQ solves in EDM's Heun sampler, on a trained DEQ denoiser: solver iterations per evaluation
overall and by noise level, and whether the samples stay the same in distribution (KID of each, and of their
difference, with standard errors over disjoint sample blocks).

The network: `configs/edm/deq_mnist.yaml` (ngf 16, the DEQ middle at 14x14, forward solves to a relative residual
of 1e-3 in at most 30 Anderson iterations) after 722 training steps on 2 CPU cores (25 minutes), its trained
weights (not their average) in `deq_mnist_722_trained.pt` beside this file. Both ways draw SAMPLES samples from
the same seed through the configs' sampler (18 Heun steps, 35 evaluations, sigma 80 to 0.002, rho 7): the starts
and every step's arithmetic are the same, only the DEQ's initial guess differs (zero, or the previous evaluation's
fixed point).

KID against the Inception features of the first REFERENCE MNIST training images: the mean over 100 subsets, and
the standard error over 5 disjoint sample blocks (`deqscore.metrics.quality.kid_standard_error`). The difference
warm - cold is paired: block by block, the same reference rows, then its standard error over the blocks.

Run (one thread, about 5 core-minutes)::

    OMP_NUM_THREADS=1 PYTHONPATH=.:lab python benchmarks/results/edm_sampling/warm_cold.py
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from deqlab.configs import build
from deqlab.measure import environment
from deqscore.data.mnist import load_mnist
from deqscore.deq import DEQ
from deqscore.metrics.inception import InceptionFeatures
from deqscore.metrics.quality import KID_BLOCKS, kernel_inception_distance, kid_blocks
from deqscore.metrics.reference import image_stats

HERE = Path(__file__).parent
SAMPLES, REFERENCE, SEED = 500, 1000, 7


def draw(module, warm: bool) -> tuple[torch.Tensor, dict]:
    """SAMPLES samples of seed SEED, warm or cold; the solver iterations of every evaluation, by noise level."""
    layers = [m for m in module.net.modules() if isinstance(m, DEQ)]
    by_level: dict[str, list[int]] = {}

    def count(_net, args, _out):
        by_level.setdefault(f"{float(args[1][0]):.4g}", []).append(sum(int(d.stats.nstep) for d in layers))

    handle = module.net.register_forward_hook(count)
    started = time.process_time()
    try:
        x = module.sample(SAMPLES, torch.Generator().manual_seed(SEED), warm=warm)
    finally:
        handle.remove()
    every = [n for counts in by_level.values() for n in counts]
    return x, {"evaluations_per_sample": len(every), "iterations_per_evaluation": float(np.mean(every)),
               "iterations_per_sample": int(sum(every)),
               "by_level": {k: float(np.mean(v)) for k, v in by_level.items()},
               "sample_core_s": round(time.process_time() - started, 1)}


def main() -> None:
    module = build("configs/edm/deq_mnist.yaml", {"net.dim": 784, "sampler.progress": False})
    module.net.load_state_dict(torch.load(HERE / "deq_mnist_722_trained.pt"))
    extractor = InceptionFeatures()
    started = time.process_time()
    images = load_mnist(train=True)[0][:REFERENCE]
    reference = image_stats(torch.as_tensor(images).unsqueeze(1).float() / 255, extractor).features
    results = {**environment(torch.device("cpu")), "samples": SAMPLES, "reference": REFERENCE, "seed": SEED,
               "kid_blocks": KID_BLOCKS, "ways": {}}
    drawn, blocks = {}, {}
    for way in ("cold", "warm"):
        x, record = draw(module, warm=way == "warm")
        features = image_stats(x.reshape(-1, 1, 28, 28), extractor).features
        kid = kernel_inception_distance(features, reference, seed=0)
        drawn[way], blocks[way] = x, kid_blocks(features, reference)
        record |= {"kid": kid["kid"], "kid_se": kid["kid_se"]}
        results["ways"][way] = record
        print(way, json.dumps(record), flush=True)
    difference = blocks["warm"] - blocks["cold"]
    cold, warm = results["ways"]["cold"], results["ways"]["warm"]
    results["warm_minus_cold"] = {
        "kid": warm["kid"] - cold["kid"], "kid_paired_blocks": float(difference.mean()),
        "kid_paired_se": float(difference.std()) / math.sqrt(KID_BLOCKS),
        "pixel_abs_diff": float((drawn["warm"] - drawn["cold"]).abs().mean()),
        "pixel_abs_diff_max": float((drawn["warm"] - drawn["cold"]).abs().max()),
        "saving": cold["iterations_per_evaluation"] / warm["iterations_per_evaluation"]}
    results["core_s"] = round(time.process_time() - started, 1)
    print(json.dumps(results["warm_minus_cold"]))
    (HERE / "warm_cold.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
