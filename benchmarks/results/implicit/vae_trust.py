"""Trust figures of the VAE's score DEQ trained with backward=implicit for the study's budget (6,000 iterations,
seed 0; validation without AIS, the checkpoint on val/loss): the exact backward's gradient error on trained weights,
outside the study's units. Run from the repository root: ``OMP_NUM_THREADS=1 python
benchmarks/results/implicit/vae_trust.py`` (RUNS: the runs' folder, default /tmp/deqscore-trust); writes
vae_trust.json beside itself."""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]
import torch
from deqscore.cli.train import main as train
from deqscore.lightning.run_hooks import batch_inputs
from deqlab.study.trust import trust_figures
from deqlab.measure import code_version
torch.set_num_threads(1)
runs = Path(os.environ.get("RUNS", "/tmp/deqscore-trust"))
start = time.time()
cli = train(["fit", "--config", str(ROOT / "configs" / "vae" / "deq_mnist.yaml"), "--seed_everything=0",
             "--model.init_args.net.init_args.deq.init_args.backward=implicit", "--trainer.max_steps=18000",
             "--trainer.max_epochs=-1", "--trainer.enable_progress_bar=false", "--model.init_args.val_ais_batches=0",
             "--trainer.limit_val_batches=2", "--trainer.callbacks.checkpoint.init_args.monitor=val/loss",
             "--run_name=vae_implicit", f"--runs_root={runs}"])
module = cli.model
dm = cli.datamodule
dm.setup("test")
batch = next(iter(dm.test_dataloader()))
x = module.prepare_batch(batch_inputs(batch).to(module.device)[:128])
figures = trust_figures(module, x)
out = {"what": "VAE (MNIST, configs/vae/deq_mnist.yaml) with backward=implicit, 18,000 optimiser steps (the study's 6,000 iterations), seed 0; trust figures on the final (trained) weights, first 128 test images",
       "code": code_version(), "torch": torch.__version__, "threads": 1, "seconds": time.time() - start, "trust": figures}
(Path(__file__).parent / "vae_trust.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
