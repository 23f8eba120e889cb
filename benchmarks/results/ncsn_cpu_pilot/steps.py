"""Twenty training steps (annealed DSM, Adam) of an NCSN MNIST config at the study's size (ngf 16, batch 64) on one
CPU thread: a whole process to time, at two commits, with a public timer, e.g. from the repository root
    /usr/bin/time -f "%U s user" python benchmarks/results/ncsn_cpu_pilot/steps.py explicit   # or: deq
(start-up and building the module included, about 6.5 s on the study's CPU)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "lab"))
from deqlab.configs import build  # noqa: E402

BODIES = ("explicit", "deq")
if len(sys.argv) != 2 or sys.argv[1] not in BODIES:
    sys.exit(f"steps.py: give the body, one of {', '.join(BODIES)} (configs/ncsn/<body>_mnist.yaml)")
torch.set_num_threads(1)
torch.manual_seed(0)
module = build(f"configs/ncsn/{sys.argv[1]}_mnist.yaml", {"net.ngf": 16, "net.dim": 784}).train()
optimizer = torch.optim.Adam(module.parameters(), 1e-4)
x = torch.rand(64, 784)
for _ in range(20):
    optimizer.zero_grad()
    module.compute_loss(x).mean().backward()
    optimizer.step()
