"""The EDM DEQ's IFT backward, Picard (the Neumann series) against Anderson, on the CPU.

From the trained weights in `benchmarks/results/edm_sampling/deq_mnist_722_trained.pt` (configs/edm/deq_mnist.yaml
after 722 steps), Adam at LR on random batches of BATCH MNIST training images for STEPS more steps, the IFT
backward's solve by SOLVER (the config's ift_tol 1e-4 and ift_max_iter 60). Every 50 steps: the largest spectral
radius of the block's Jacobian at the fixed point over 32 fixed images (power iteration,
`deqlab.study.trust.spectral_radius`) and the backward's mean iterations; every step whose backward solve missed
ift_tol, with its relative residual. One JSON object a line on stdout.

Run from the repository root (one thread, about 9 core-minutes for 400 steps)::

    OMP_NUM_THREADS=1 python benchmarks/results/edm_backward/ift_solver.py 128 1e-3 400 anderson
"""
from __future__ import annotations

import json
import sys
import time
import warnings

import torch

from deqlab.configs import build
from deqlab.study.trust import captured_solves, spectral_radius
from deqscore.data.mnist import load_mnist
from deqscore.data.transforms import preprocess

WEIGHTS = "benchmarks/results/edm_sampling/deq_mnist_722_trained.pt"


def largest_radius(module, data: torch.Tensor) -> float:
    x = data[torch.randint(len(data), (32,), generator=torch.Generator().manual_seed(1))]
    layers = module.deq_layers()
    with captured_solves(layers) as solves, torch.no_grad():
        module.loss_terms(x)
    return float(torch.cat([spectral_radius(layer, z, u) for layer, u, z, _ in solves]).max())


def main(batch: int, lr: float, steps: int, ift_solver: str) -> None:
    torch.manual_seed(0)
    module = build("configs/edm/deq_mnist.yaml", {"net.dim": 784, "sampler.progress": False,
                                                  "net.deq.ift_solver": ift_solver})
    module.net.load_state_dict(torch.load(WEIGHTS))
    (layer,) = module.deq_layers()
    layer.warn_on_nonconvergence = False  # counted below instead
    images, _ = load_mnist(train=True)
    data = preprocess(torch.from_numpy(images).reshape(len(images), -1), "pixels")
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    module.train()
    started, iterations = time.time(), []
    for step in range(steps + 1):
        if step % 50 == 0:
            print(json.dumps({"step": step, "radius": round(largest_radius(module, data), 4),
                              "s": round(time.time() - started)}), flush=True)
        if step == steps:
            break
        x = data[torch.randint(len(data), (batch,), generator=gen)]
        optimizer.zero_grad(set_to_none=True)
        loss = module.loss_terms(x)["loss"]
        loss.backward()
        optimizer.step()
        stats = layer.adjoint_stats[1]
        iterations.append(stats.nstep)
        if not stats.converged:
            print(json.dumps({"step": step, "ift_miss": stats.rel_residual, "loss": round(float(loss), 4)}), flush=True)
        if step % 50 == 49:
            print(json.dumps({"step": step, "backward_iterations_mean": sum(iterations) / len(iterations)}), flush=True)
            iterations.clear()


if __name__ == "__main__":
    warnings.simplefilter("ignore", UserWarning)
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
