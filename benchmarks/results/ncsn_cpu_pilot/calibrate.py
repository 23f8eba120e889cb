"""Calibration pilot of the CPU image protocol (benchmarks/protocol/ncsn_cpu_v1.json, "pilot"): process CPU seconds
of one training step (batch 64), one held-out evaluation (batch 500) and one sampler evaluation (batch 50, warm
DEQ starts) per arm at ngf 16, one thread, then the rules R1-R3 applied to them. FAMILY=ncsn (default) or edm.
Writes calibration.json (calibration_edm.json) beside itself (or to $OUT). Run from the repository root:
``OMP_NUM_THREADS=1 python benchmarks/results/ncsn_cpu_pilot/calibrate.py``. Process CPU time, not wall time: the
machine it ran on was shared."""
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "lab")]
from deqlab.configs import build  # noqa: E402

from deqscore.data import load_mnist  # noqa: E402
from deqscore.metrics.inception import InceptionFeatures  # noqa: E402

torch.set_num_threads(1)
OUT = Path(os.environ.get("OUT", Path(__file__).parent))
ITERATIONS = int(os.environ.get("ITERATIONS", 300))
FAMILY = os.environ.get("FAMILY", "ncsn")
ARMS = {"ncsn": {"explicit": "configs/ncsn/explicit_mnist.yaml", "deq": "configs/ncsn/deq_mnist.yaml",
                 "ncsnv2": "configs/ncsn/ncsnv2_mnist.yaml"},
        "edm": {"explicit": "configs/edm/explicit_mnist.yaml", "deq": "configs/edm/deq_mnist.yaml"}}[FAMILY]
BUDGET = {"training": 720, "held_out": 650, "sampling_and_kid": 430}  # core-seconds, the protocol's split
# network evaluations per sample by sampler steps: NCSN 10 levels x steps per level + the final denoising step;
# EDM's Heun sampler, 18 steps, 35 evaluations
EVALUATIONS_PER_SAMPLE = {"ncsn": {100: 1001, 20: 201}, "edm": {18: 35}}[FAMILY]
HELD_OUT_PASSES = {"ncsn": 10, "edm": 1}[FAMILY]  # forward passes per test image: every level, or one draw
NAME = "calibration.json" if FAMILY == "ncsn" else f"calibration_{FAMILY}.json"


def cpu(fn, repeat: int) -> float:
    """Process CPU seconds per call of ``fn`` (the first call, a warm-up, not counted)."""
    fn()
    start = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - start) / repeat


images, _ = load_mnist("datasets", train=True)
train = torch.from_numpy(images).reshape(len(images), -1).float().div(255)
result: dict = {"family": FAMILY, "ngf": 16, "batch": 64, "iterations_timed": ITERATIONS, "threads": 1, "arms": {},
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
for arm, config in ARMS.items():
    module = build(config, {"net.dim": 784, "net.ngf": 16, **({"sampler.progress": False} if FAMILY == "ncsn" else {})})
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(2019)

    def step():
        x = train[torch.randint(len(train), (64,), generator=generator)]
        optimizer.zero_grad(set_to_none=True)
        module.loss_terms(x)["loss"].backward()
        optimizer.step()

    train_step = cpu(step, ITERATIONS)
    net = module.net.eval()
    levels = getattr(module, "sigmas", torch.tensor([1.0, 0.01]))  # EDM: two levels of its range
    with torch.no_grad():
        x500 = train[:500]
        held = cpu(lambda: net(x500 + levels[-1] * torch.randn_like(x500), levels[-1].expand(500)), 4)
        for layer in (m for m in net.modules() if hasattr(m, "warm_start")):
            layer.warm_start = True
        x50 = train[:50]
        sample_eval = cpu(lambda: net(x50 + 1e-3 * torch.randn_like(x50), levels[-1].expand(50)), 20)
    result["arms"][arm] = {"train_step_core_s": train_step, "held_out_batch500_core_s": held,
                           "sampler_evaluation_batch50_core_s": sample_eval}
    (OUT / NAME).write_text(json.dumps(result, indent=1))

inception = InceptionFeatures()
with torch.no_grad():
    rgb = torch.rand(50, 1, 28, 28)
    result["inception_per_image_core_s"] = cpu(lambda: inception(rgb), 2) / 50

# the rules, as the protocol states them
costliest_step = max(a["train_step_core_s"] for a in result["arms"].values())
iterations = int(BUDGET["training"] / costliest_step // 100 * 100)
costliest_eval = max(a["sampler_evaluation_batch50_core_s"] for a in result["arms"].values()) / 50
held_out = max(a["held_out_batch500_core_s"] for a in result["arms"].values()) * 20 * HELD_OUT_PASSES  # 10,000 images
rules = {"R1_iterations": iterations}
for steps, evaluations in EVALUATIONS_PER_SAMPLE.items():
    per_sample = evaluations * costliest_eval + result["inception_per_image_core_s"]
    samples = int(BUDGET["sampling_and_kid"] / per_sample // 50 * 50)
    rules[f"R2_samples_at_{steps}_steps_per_level"] = samples
    if samples >= 100:
        rules["R2_steps_per_level"], rules["R2_samples"] = steps, samples
        break
else:  # under 100 samples at the fewest steps: 100 samples, and the unit's budget grows (said by R2_over_budget)
    rules["R2_steps_per_level"], rules["R2_samples"], rules["R2_over_budget"] = steps, 100, True
rules["R3_held_out_core_s"] = held_out
rules["R3_overrun"] = held_out > BUDGET["held_out"]
result["rules"] = rules
(OUT / NAME).write_text(json.dumps(result, indent=1))
print(json.dumps(result, indent=1))
