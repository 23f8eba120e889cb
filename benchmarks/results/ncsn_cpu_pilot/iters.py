"""Solver iterations per evaluation, cold vs warm, per noise level and per tolerance, through the configs' sampler
(10 levels 1 -> 0.01, step_lr 2e-5) on an untrained DEQ NCSN (the map is normalised to a contraction of about 1/2
whatever the weights, so counts are set mostly by the map's normalisation); and how far a looser tolerance moves
the samples (same seed) compared with the noise one Langevin step injects at the last level."""
import json
import sys
from functools import partial
from pathlib import Path

import torch

from deqscore.deq import DEQ
from deqscore.losses import noise_schedule
from deqscore.models import NCSN
from deqscore.sampling import AnnealedLangevin

NGF, T, NS = int(sys.argv[1]), int(sys.argv[2]), 8
sigmas = noise_schedule("geometric", 1.0, 0.01, 10).float()
out = {"ngf": NGF, "steps_per_level": T, "samples": NS}
ref = None
for tol in (1e-4, 1e-3, 1e-2):
    for warm in (False, True):
        torch.manual_seed(2019)
        net = NCSN(dim=784, channels=1, ngf=NGF, body="deq",
                   deq=partial(DEQ, max_iter=64, tol=tol, stop_mode="rel", warn_on_nonconvergence=False)).eval()
        net.body.deq.warm_start, net.body.deq.z_cache = warm, None
        per = {}

        def score(x, s):
            y = net(x, s)
            per.setdefault(f"{float(s[0]):.4g}", []).append(net.body.deq.stats.nstep)
            return y
        with torch.no_grad():
            x = AnnealedLangevin(T, 2e-5, progress=False)(score, (NS, 784), sigmas, torch.Generator().manual_seed(0))
        rec = {"per_level": {k: round(sum(v) / len(v), 2) for k, v in per.items()},
               "mean": round(sum(sum(v) for v in per.values()) / sum(len(v) for v in per.values()), 2)}
        if ref is None:
            ref = x
        rec["rms_diff_vs_tol1e-4_cold"] = float((x - ref).pow(2).mean().sqrt())
        out[f"tol{tol:g}_{'warm' if warm else 'cold'}"] = rec
        print(tol, warm, rec, flush=True)
out["last_level_step_noise_rms"] = (2 * 2e-5) ** 0.5
json.dump(out, open(Path(__file__).parent / f"iters_ngf{NGF}_T{T}.json", "w"), indent=1)
