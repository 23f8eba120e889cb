"""Device pilot: the CPU setting of the blank-sample report (ngf 32, batch 64, Adam 1e-3, 1,500 steps, EMA 0.999)
for the DEQ and the explicit NCSN bodies, then diagnostics: held-out denoising loss per level (raw and EMA), samples
with 100 and 10 steps per level, final denoise on/off, raw vs EMA, cold vs warm solver iterations per level, and a
drift test (chains started at test images at one small level). Writes to $OUT; results.json grows as it goes."""
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "lab")]
from deqlab.configs import build  # noqa: E402
from deqscore.data import load_mnist  # noqa: E402
from deqscore.sampling.grid import save_image_grid  # noqa: E402
from deqscore.sampling.langevin import AnnealedLangevin  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/pilot_out"))
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STEPS = int(os.environ.get("STEPS", 1500))
NGF = int(os.environ.get("NGF", 32))
NS = int(os.environ.get("NS", 64))
results: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "steps": STEPS, "ngf": NGF}
T0 = time.time()


def dump():
    results["elapsed_s"] = time.time() - T0
    (OUT / "results.json").write_text(json.dumps(results, indent=1))


train = torch.from_numpy(load_mnist("datasets", train=True)[0]).reshape(-1, 784).float().div(255).to(dev)
test = torch.from_numpy(load_mnist("datasets", train=False)[0][:int(os.environ.get("TESTN", 10000))])
test = test.reshape(-1, 784).float().div(255).to(dev)
CONFIGS = {"deq": "configs/ncsn/deq_mnist.yaml", "explicit": "configs/ncsn/explicit_mnist.yaml"}
nets = {}
for label, cfg in CONFIGS.items():
    module = build(cfg, {"net.dim": 784, "sampler.progress": False, "net.ngf": NGF}).to(dev)
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    ema = AveragedModel(module.net, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    module.train()
    t = time.time()
    for step in range(STEPS):
        x = train[torch.randint(len(train), (64,), device=dev, generator=gen)]
        opt.zero_grad(set_to_none=True)
        loss = module.loss_terms(x)["loss"]
        loss.backward()
        opt.step()
        ema.update_parameters(module.net)
    torch.cuda.synchronize() if dev.type == "cuda" else None
    results[f"{label}_train_s"] = time.time() - t
    results[f"{label}_last_loss"] = float(loss)
    torch.save({"raw": module.net.state_dict(), "ema": ema.module.state_dict()}, OUT / f"{label}_ngf{NGF}_{STEPS}.pt")
    nets[label] = (module, module.net, ema.module)
    dump()

sigmas = nets["deq"][0].sigmas


@torch.no_grad()
def heldout(net):
    net.eval()
    g = torch.Generator(device=dev).manual_seed(123)
    per = []
    for s in sigmas.tolist():
        tot = 0.0
        for i in range(0, len(test), 1000):
            x = test[i:i + 1000]
            e = torch.randn(x.shape, generator=g, device=dev)
            lv = torch.full((len(x),), s, device=dev)
            out = net(x + s * e, lv)
            tot += float((0.5 * (s * out + e).pow(2).sum(1)).sum())
        per.append(tot / len(test))
    return per


for label, (module, raw, ema) in nets.items():
    results[f"{label}_heldout_raw"] = heldout(raw)
    results[f"{label}_heldout_ema"] = heldout(ema)
    dump()


def deqs(net):
    from deqscore.deq import DEQ
    return [m for m in net.modules() if isinstance(m, DEQ)]


@torch.no_grad()
def run_sampler(net, T, final=True, warm=True, name=""):
    net.eval()
    layers = deqs(net)
    for m in layers:
        m.warm_start, m.z_cache = warm, None
    iters: dict = {}
    mass = []

    def score(x, lv):
        out = net(x, lv)
        for m in layers:
            iters.setdefault(round(float(lv[0]), 5), []).append(m.stats.nstep)
        return out

    sampler = AnnealedLangevin(n_steps_each=max(1, T // int(os.environ.get("TDIV", 1))), step_lr=2e-5, final_denoise=final, progress=False)
    g = torch.Generator(device=dev).manual_seed(7)
    x = sampler(score, (NS, 784), sigmas, g, device=dev)
    for m in layers:
        m.warm_start, m.z_cache = False, None
    img = x.clamp(0, 1)
    save_image_grid(img[:64].reshape(-1, 1, 28, 28), OUT / f"{name}.png", nrow=8)
    rec = {"pixel_max_mean": float(img.amax(1).mean()), "pixel_mean": float(img.mean()),
           "frac_blank(max<0.3)": float((img.amax(1) < 0.3).float().mean())}
    if iters:
        rec["iters_per_level"] = {k: float(np.mean(v)) for k, v in iters.items()}
        rec["iters_mean"] = float(np.mean([i for v in iters.values() for i in v]))
    return rec


plan = [("deq", "ema", 100, True, True), ("explicit", "ema", 100, True, True), ("deq", "ema", 10, True, True),
        ("deq", "raw", 100, True, True), ("deq", "ema", 100, False, True), ("deq", "ema", 100, True, False),
        ("explicit", "raw", 100, True, True), ("explicit", "ema", 10, True, True)]
for label, which, T, final, warm in plan:
    module, raw, ema = nets[label]
    net = ema if which == "ema" else raw
    name = f"{label}_{which}_T{T}{'' if final else '_nofinal'}{'' if warm else '_cold'}"
    t = time.time()
    results[name] = run_sampler(net, T, final, warm, name) | {"s": time.time() - t}
    dump()


@torch.no_grad()
def drift(net, level_idx, T=100):
    """Chains started at test images + sigma noise, run at one level for T steps: how much of the image is kept."""
    net.eval()
    g = torch.Generator(device=dev).manual_seed(11)
    x0 = test[:NS]
    s = float(sigmas[level_idx])
    alpha = 2e-5 * (s / float(sigmas[-1])) ** 2
    lv = torch.full((NS,), s, device=dev)
    x = x0 + s * torch.randn(x0.shape, generator=g, device=dev)
    for _ in range(T):
        x = x + alpha * net(x, lv) + (2 * alpha) ** 0.5 * torch.randn(x.shape, generator=g, device=dev)
    den = x + s**2 * net(x, lv)
    ink0 = (x0 * (x0 > 0.5)).sum(1)
    return {"ink_ratio": float(((den.clamp(0, 1) * (x0 > 0.5)).sum(1) / ink0).mean()),
            "rmse_to_start": float((den.clamp(0, 1) - x0).pow(2).mean().sqrt())}


for label, (module, raw, ema) in nets.items():
    results[f"{label}_drift"] = {f"{float(sigmas[i]):.4g}": drift(ema, i) for i in range(len(sigmas))}
    dump()
results["done"] = True
dump()
