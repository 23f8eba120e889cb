"""Known-answer control for the NCSN MNIST sampler: the exact score of N training images smoothed by sigma (a mixture
of Gaussians centred at them) through the configs' annealed Langevin sampler (10 levels 1 -> 0.01, step_lr 2e-5),
with 100 and 10 steps per level; then the same score with a denoiser that dims ink by a factor (1 - delta) at the
small levels only (sigma <= cut), the kind of small-sigma error a score network can have."""
import json
import sys
from pathlib import Path

import torch

from deqscore.data import load_mnist
from deqscore.losses import noise_schedule
from deqscore.sampling.langevin import AnnealedLangevin

N, NS = int(sys.argv[1]) if len(sys.argv) > 1 else 16, 64
mu = torch.from_numpy(load_mnist("datasets", train=True)[0][:N]).reshape(N, 784).double() / 255
sigmas = noise_schedule("geometric", 1.0, 0.01, 10).double()


def denoiser(x, s):
    logits = -torch.cdist(x, mu).pow(2) / (2 * s[:, None] ** 2)
    return torch.softmax(logits, 1) @ mu


def score_fn(delta=0.0, cut=0.05, kind="dim"):
    def score(x, s):
        den = denoiser(x, s)
        small = (s <= cut + 1e-9)[:, None]
        if kind == "dim":  # ink dimmed: the denoiser pulls towards a fainter image
            den = torch.where(small, (1 - delta) * den, den)
        return (den - x) / s[:, None] ** 2
    return score


def summary(x):
    x = x.clamp(0, 1)
    near = torch.cdist(x, mu).min(1).values / 28  # RMSE to the nearest training image
    return {"pixel_max_mean": round(float(x.amax(1).mean()), 3), "ink_mean": round(float(x.sum(1).mean()), 1),
            "rmse_nearest_mean": round(float(near.mean()), 4), "frac_reproduced(rmse<0.05)": float((near < 0.05).double().mean())}


def excess_loss(delta, s, n=2000):
    """Held-out-loss excess of the dimmed denoiser at level s: E 1/2 ||sigma s_delta + eps||^2 minus the exact one."""
    g = torch.Generator().manual_seed(3)
    x0 = mu[torch.randint(N, (n,), generator=g)]
    e = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    lv = torch.full((n,), s, dtype=torch.float64)
    ex = [float((0.5 * (s * score_fn(dl, cut=1.0)(x0 + s * e, lv) + e).pow(2).sum(1)).mean()) for dl in (0.0, delta)]
    return ex


out = {"N": N, "samples": NS, "ink_mean_data": round(float(mu.sum(1).mean()), 1)}
for T in (100, 10):
    sampler = AnnealedLangevin(n_steps_each=T, step_lr=2e-5, progress=False)
    for delta in (0.0, 0.005, 0.01, 0.02, 0.05):
        x = sampler(score_fn(delta), (NS, 784), sigmas, torch.Generator().manual_seed(0), dtype=torch.float64)
        out[f"T{T}_delta{delta}"] = summary(x)
        print(T, delta, out[f"T{T}_delta{delta}"], flush=True)
out["loss_exact_vs_dimmed_sigma0.01"] = {str(dl): excess_loss(dl, 0.01) for dl in (0.005, 0.01, 0.02)}
print(json.dumps(out, indent=1))
json.dump(out, open(Path(__file__).parent / f"exact_control_N{N}.json", "w"), indent=1)
