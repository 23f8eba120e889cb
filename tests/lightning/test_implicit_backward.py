"""Every family's DEQ config trains with the exact backward chosen by one option,
``net.init_args.deq.init_args.backward: implicit`` (docs/method.md 2.6): the construction-time checks accept it,
two steps run, and the nested solves' statistics are logged beside the forward's."""

import pytest
import torch

from deqscore.cli.train import main
from deqscore.deq import DEQ
from deqscore.families import declarations
from tests.families import NET

from .config_losses import TWO_STEPS, logged_training
from .conftest import ROOT, tiny_args

DEQ_CONFIGS = {name: ROOT / "configs" / name / d.configs["deq"] for name, d in declarations().items()
               if "deq" in d.configs}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "ncsn" else f  # ncsn: ~40 s
                                    for f in DEQ_CONFIGS])
def test_a_deq_config_trains_with_the_implicit_backward(family, tmp_path):
    cli = main(["fit", *tiny_args(tmp_path, DEQ_CONFIGS[family], "i"), *TWO_STEPS,
                f"{NET}.deq.init_args.backward", "implicit"])
    deqs = [m for m in cli.model.modules() if isinstance(m, DEQ)]
    assert deqs and all(d.backward == "implicit" for d in deqs)
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    logged = logged_training(tmp_path / "i")
    assert logged and all(row["train/deq/converged"] == 1.0 for row in logged)
    if all(d.direct for d in deqs):  # DKEF's linear map: one linear solve, no adjoint iterations
        assert all(row["train/deq/nstep"] == 1.0 and "train/deq/adjoint_nstep" not in row for row in logged)
    else:  # the adjoint solves of the step (the previous step's parameter gradient at least) are logged
        assert logged[-1]["train/deq/adjoint_nstep"] >= 1 and logged[-1]["train/deq/adjoint_converged"] == 1.0


def test_a_torch_without_node_hooks_trains_the_exact_backward_without_its_memory_figure(tmp_path, monkeypatch):
    """Before torch 2.14 (here: its node-creation hook taken away) the activation meter falls back on saved-tensor
    hooks, under which torch.func refuses to run: the run says that it logs no activation memory, and trains."""
    monkeypatch.delattr(torch.autograd.graph, "node_creation_hook", raising=False)
    with pytest.warns(UserWarning, match="run/activation_memory_mb is not logged: torch .* cannot measure"):
        cli = main(["fit", *tiny_args(tmp_path, DEQ_CONFIGS["nice"], "old"), *TWO_STEPS,
                    f"{NET}.deq.init_args.backward", "implicit"])
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    header = (tmp_path / "old" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "run/parameters" in header and "run/activation_memory_mb" not in header
