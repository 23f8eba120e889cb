"""On a GPU: the NCSN DEQ's MNIST config trained once by the GPU program's image stage (`deqlab.gpu_images.train`)
while an average of its weights (decay 0.999, the configs' EMA) is kept beside it; then the trained weights and
the average are each sampled (the config's sampler, seed 0) and scored by KID against the 10,000 MNIST test images.
Run from the repository root: python benchmarks/results/gpu/average_vs_trained/average_vs_trained.py OUT INCEPTION
"""
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "lab")]
from deqlab import gpu_images  # noqa: E402
from deqlab.configs import build  # noqa: E402
from deqlab.gpu import IMAGES  # noqa: E402
from deqscore.metrics.inception import InceptionFeatures  # noqa: E402

TRAIN_S, SAMPLES, DECAY = 55.0, 300, 0.999  # what one short GPU call allows
out_dir, inception = Path(sys.argv[1]), sys.argv[2]
quick = not torch.cuda.is_available()  # a dry run on the CPU at the image stage's quick sizes
device = torch.device("cpu" if quick else "cuda")
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
plan = replace(IMAGES["quick" if quick else "full"], samples=10 if quick else SAMPLES, sample_s=float("inf"))
family = next(f for f in gpu_images.IMAGE_FAMILIES if f.name == "ncsn")
config = family.configs["DEQ"]
module = build(config, {**family.options, **(family.quick["DEQ"] if quick else {})}).to(device)
average = AveragedModel(module.net, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
make_optimiser = gpu_images.instantiate_class


def optimiser_that_averages(params, spec):
    optimiser = make_optimiser(params, spec)
    step = optimiser.step

    def step_and_average(*args, **kwargs):
        result = step(*args, **kwargs)
        average.update_parameters(module.net)
        return result

    optimiser.step = step_and_average
    return optimiser


gpu_images.instantiate_class = optimiser_that_averages
record = {"device": "cpu (dry run)" if quick else torch.cuda.get_device_name(), "config": config, "decay": DECAY,
          **gpu_images.train(module, config, gpu_images._mnist(True).to(device), plan, TRAIN_S)}
extractor = InceptionFeatures(None if quick else inception).to(device)
reference = extractor(gpu_images._mnist(False, plan.reference).reshape(-1, 1, 28, 28).to(device))
for name, net in (("trained", module.net), ("average", average.module)):
    module.net = net
    images, sampled = gpu_images.sample(module, plan, device)
    gpu_images.save_image_grid(images[:64], out_dir / f"ncsn_deq_{name}.png", nrow=8)
    record[name] = {**sampled, **gpu_images.score(extractor(images), reference, plan.seed, fid=False)}
    print(name, record[name], flush=True)
    (out_dir / "average_vs_trained.json").write_text(json.dumps(record, indent=1))
