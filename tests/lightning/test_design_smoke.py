"""The default DEQ designs train on real MNIST through the CLI: the loss of a fixed held-out batch (same noise
draws) falls against the same network before training by several standard errors of the paired per-item
difference, samples are finite, and the solver's iterations and final residual are logged and converged."""

import csv
import math

import pytest
import torch

from deqscore.cli.train import DeqscoreCLI, main
from deqscore.lightning.run_hooks import batch_inputs

from .conftest import ROOT

NET = "--model.init_args.net.init_args"
COMMON = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
          "--trainer.log_every_n_steps", "5", "--trainer.limit_val_batches", "1",
          "--data.init_args.train_subset", "512", "--data.init_args.val_subset", "64",
          "--data.init_args.test_subset", "16", "--data.init_args.batch_size", "32",
          "--data.init_args.eval_batch_size", "64", "--data.init_args.num_workers", "0"]
DESIGNS = {
    # the half-resolution body at a small width, annealed DSM as configured (IFT backward)
    "ncsn": ("configs/ncsn/deq_mnist.yaml", ["--trainer.max_steps", "40", f"{NET}.ngf", "8",
                                             "--model.init_args.sampler.init_args.n_steps_each", "3"]),
    # the MLP design; 90 optimiser steps are 30 iterations of 2 score steps and 1 encoder/decoder step
    "vae_mlp": ("configs/vae/deq_mnist.yaml", ["--trainer.max_steps", "90", f"{NET}.hidden", "64",
                                              "--model.init_args.val_ais_steps", "10"]),
}


def _paired_drop(before: torch.Tensor, after: torch.Tensor) -> float:
    """Mean per-item decrease over its standard error."""
    d = before - after
    return (d.mean() / (d.std() / math.sqrt(len(d)))).item()


def _per_item(module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)  # the same noise levels, noise and projections before and after training
    with torch.enable_grad():
        terms = module.compute_loss(x)
    terms = terms if isinstance(terms, dict) else {"loss": terms}
    return {k: v.detach() for k, v in terms.items()}


@pytest.mark.parametrize("design", sorted(DESIGNS))
def test_default_design_trains_on_mnist(design, tmp_path):
    config, extra = DESIGNS[design]
    args = ["fit", "--config", str(ROOT / config), "--runs_root", str(tmp_path), "--run_name", design, *COMMON, *extra]
    untrained = DeqscoreCLI(args=args[1:], run=False).model  # instantiated as fit does: the same seed, the same init
    cli = main(args)
    module, dm = cli.model, cli.datamodule
    x = module.prepare_batch(batch_inputs(next(iter(dm.val_dataloader()))))
    before, after = _per_item(untrained.eval(), x), _per_item(module.eval(), x)
    for name in before:
        assert _paired_drop(before[name], after[name]) > 3, name
    torch.manual_seed(0)
    assert torch.isfinite(module.sample(4)).all()
    rows = list(csv.DictReader((tmp_path / design / "metrics.csv").open()))
    logged = [r for r in rows if r.get("train/deq/nstep")]
    assert len(logged) >= 5
    assert all(float(r["train/deq/converged"]) == 1.0 for r in logged)
    cap = next(d.max_iter for d in module.deq_layers())
    assert all(float(r["train/deq/nstep"]) < cap for r in logged)
    if design == "ncsn":  # IFT backward: its failure fraction is logged
        assert all(float(r["train/deq/ift_backward_failures"]) == 0.0 for r in logged[1:])
