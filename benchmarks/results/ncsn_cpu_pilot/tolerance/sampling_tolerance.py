"""Does annealed Langevin sampling need the DEQ's training tolerance? The CPU pilot's DEQ NCSN (width 16, 1,500
steps, trained weights, ``deq_ngf16_1500_trained.pt`` beside this file) samples with protocol v6's sampler (20
steps per level, step_lr 2e-5, final denoising step) three ways, every draw of noise the same:

* ``fixed``: the config's tolerance, 1e-4 (relative residual), at every level;
* ``per_level``: 1e-4 x sigma_i / sigma_L, looser where the injected noise is larger (1e-2 at sigma 1);
* ``loose``: 1e-2 at every level.

Why a looser solve may do: a Langevin step adds ``alpha_i s + sqrt(2 alpha_i) xi`` with ``alpha_i = eps (sigma_i /
sigma_L)^2``. A relative solver error r moves the step by about ``alpha_i r |s|`` with ``|s| ~ sqrt(D) / sigma_i``,
against noise of ``sqrt(2 alpha_i D)``: the ratio ``r sqrt(eps / 2) / sigma_L`` is the same at every level, 0.03 at
r = 1e-2 (eps 2e-5, sigma_L 0.01). So a per-level rule has no footing in the noise, and a uniform 1e-2 keeps the
solver's error near a thirtieth of the noise.

Each way records solver iterations per evaluation (overall and per level), KID against 5,000 MNIST training
images with the standard deviation over subsets, the paired KID difference from ``fixed`` (the same subsets of
both sets of samples and of the reference: mean and standard error over subsets) and the mean absolute pixel
difference from ``fixed``'s samples. A way is kept only if its KID is within one standard error of ``fixed``'s.

Run (one thread, about 40 core-minutes, 12 of them the reference features)::

    OMP_NUM_THREADS=1 PYTHONPATH=.:lab python benchmarks/results/ncsn_cpu_pilot/tolerance/sampling_tolerance.py
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from torchmetrics.image.kid import poly_mmd

from deqlab.configs import build
from deqscore.data.mnist import load_mnist
from deqscore.deq import DEQ
from deqscore.metrics.inception import InceptionFeatures
from deqscore.metrics.reference import image_stats
from deqscore.sampling.langevin import AnnealedLangevin

HERE = Path(__file__).parent
SAMPLES, REFERENCE, SUBSETS, SUBSET_SIZE, SEED = 500, 5000, 100, 250, 7  # subsets of half the samples
TOL = 1e-4
WAYS = {"fixed": lambda sigma, last: TOL, "per_level": lambda sigma, last: TOL * sigma / last,
        "loose": lambda sigma, last: 1e-2}


def draw(module, way: str) -> tuple[torch.Tensor, dict]:
    """SAMPLES samples from seed SEED with the DEQ's tolerance set per level by ``way``; solver iterations."""
    layers = [m for m in module.net.modules() if isinstance(m, DEQ)]
    sigma_last, iterations = float(module.sigmas[-1]), {}

    def score(x, level):
        sigma = float(level[0])
        for layer in layers:
            layer.tol = WAYS[way](sigma, sigma_last)
        out = module.net(x, level)
        iterations.setdefault(f"{sigma:.4g}", []).extend(int(layer.stats.nstep) for layer in layers)
        return out

    sampler = AnnealedLangevin(n_steps_each=20, step_lr=2e-5, final_denoise=True, progress=False)
    with module.sampling_mode(warm=True):
        x = sampler(score, (SAMPLES, 784), module.sigmas, torch.Generator().manual_seed(SEED))
    for layer in layers:
        layer.tol = TOL
    every = [i for v in iterations.values() for i in v]
    return x.clamp(0, 1), {"iterations_per_evaluation": float(np.mean(every)),
                           "per_level": {k: float(np.mean(v)) for k, v in iterations.items()}}


def mmd_per_subset(features: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Unbiased polynomial MMD^2 on SUBSETS subsets drawn from one seed: the same rows for every set of samples."""
    generator = torch.Generator().manual_seed(0)
    values = []
    for _ in range(SUBSETS):
        a = features[torch.randperm(len(features), generator=generator)[:SUBSET_SIZE]].double()
        b = reference[torch.randperm(len(reference), generator=generator)[:SUBSET_SIZE]].double()
        values.append(poly_mmd(b, a))
    return torch.stack(values)


def main() -> None:
    torch.manual_seed(0)
    module = build("configs/ncsn/deq_mnist.yaml", {"net.dim": 784, "net.ngf": 16, "sampler.progress": False})
    module.net.load_state_dict(torch.load(HERE / "deq_ngf16_1500_trained.pt"))
    extractor = InceptionFeatures()
    started = time.process_time()
    images = load_mnist(train=True)[0][:REFERENCE]
    reference = image_stats(torch.as_tensor(images).unsqueeze(1).float() / 255, extractor).features
    results = {"device": platform.processor() or platform.machine(), "torch": torch.__version__,
               "samples": SAMPLES, "reference": REFERENCE, "subsets": SUBSETS, "subset_size": SUBSET_SIZE,
               "seed": SEED, "ways": {}}
    drawn, kid = {}, {}
    for way in WAYS:
        t = time.process_time()
        x, record = draw(module, way)
        features = image_stats(x.reshape(-1, 1, 28, 28), extractor).features
        kid[way], drawn[way] = mmd_per_subset(features, reference), x
        record |= {"kid": float(kid[way].mean()), "kid_std": float(kid[way].std(unbiased=False)),
                   "sample_core_s": time.process_time() - t}
        if way != "fixed":
            diff = kid[way] - kid["fixed"]
            record |= {"kid_minus_fixed": float(diff.mean()), "kid_minus_fixed_se": float(diff.std() / SUBSETS**0.5),
                       "pixel_abs_diff_from_fixed": float((x - drawn["fixed"]).abs().mean()),
                       "within_fixed_kid_std": abs(float(diff.mean())) <= float(kid["fixed"].std(unbiased=False))}
        results["ways"][way] = record
        print(way, json.dumps(record))
    results["core_s"] = time.process_time() - started
    (HERE / "sampling_tolerance.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
