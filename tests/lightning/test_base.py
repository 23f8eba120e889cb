"""The base module serves more than NICE: named loss terms, two optimisers, the DEQ statistics of the model's own
solve, hyper-parameters that rebuild the module, and clear refusals."""

from functools import partial

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deqscore.deq import DEQ
from deqscore.errors import ConfigError
from deqscore.lightning import ScoreModule, build_module
from deqscore.losses import SSM, ScoreLoss, build_loss, score_from_log_prob
from deqscore.models import NICE


class TwoPartGaussian(ScoreModule):
    """A toy family: a Gaussian log-density ``-0.5 ||(x - mu) / s||^2`` whose scale and mean are trained by two
    optimisers in turn (as a VAE trains its score network, then its encoder/decoder), through the base's
    several-optimiser form (``optimizer_steps``), with a third logged term."""

    def __init__(self, dim: int = 3, loss: str | ScoreLoss = "exact"):
        super().__init__()
        self.mu = nn.Parameter(torch.zeros(dim))
        self.log_s = nn.Parameter(torch.zeros(dim))
        self.loss = build_loss(loss, ScoreLoss)
        self.automatic_optimization = False

    def log_prob(self, x):
        return -0.5 * ((x - self.mu) / self.log_s.exp()).pow(2).sum(1)

    def sm(self, x):
        return self.loss(score_from_log_prob(self.log_prob), x)

    def compute_loss(self, x):
        return {"loss": self.sm(x), "mean_error": (x.mean(0) - self.mu).pow(2).sum().expand(len(x))}

    def configure_optimizers(self):
        return [torch.optim.SGD([self.mu], lr=0.1), torch.optim.SGD([self.log_s], lr=0.1)]

    def optimizer_steps(self, x):
        yield 1, "scale_sm", lambda: self.sm(x)  # the scale first
        yield 0, "loss", lambda: self.sm(x)  # then the mean, at the updated scale


def _fit(module, steps, tmp_path):
    data = DataLoader(TensorDataset(torch.randn(64, 3) * 2 + 1), batch_size=16)
    trainer = pl.Trainer(max_steps=steps, logger=pl.loggers.CSVLogger(tmp_path), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, inference_mode=False,
                         log_every_n_steps=1, accelerator="cpu")
    trainer.fit(module, data)
    return trainer


def test_several_optimisers_step_in_order_each_on_its_own_parameters(tmp_path):
    # exact SM of N(mu, s^2): sum_d [-1/s_d^2 + 0.5 (x_d - mu_d)^2 / s_d^4]; closed-form gradients, hand SGD steps
    def exact_sm(x, mu, s2):
        return (-1 / s2 + 0.5 * (x - mu) ** 2 / s2**2).sum(1).mean()

    torch.manual_seed(0)
    x = (torch.randn(64, 3) * 2 + 1)[:16]  # the first batch _fit draws
    mu, s2 = torch.zeros(3), torch.ones(3)
    first = exact_sm(x, mu, s2)
    log_s = -0.1 * (2 / s2 - ((x - mu) ** 2).mean(0) * 2 / s2**2)  # d/dlog_s with s^2 = exp(2 log_s)
    s2 = torch.exp(2 * log_s)
    second = exact_sm(x, mu, s2)  # the mean's step sees the updated scale
    mu = mu - 0.1 * (-(x - mu) / s2**2).mean(0)
    module = TwoPartGaussian()
    torch.manual_seed(0)
    trainer = _fit(module, 1, tmp_path)
    torch.testing.assert_close(module.log_s.detach(), log_s)
    torch.testing.assert_close(module.mu.detach(), mu)
    assert trainer.global_step == 2  # Lightning counts every optimiser step
    metrics = trainer.callback_metrics
    torch.testing.assert_close(metrics["train/scale_sm"], first)
    torch.testing.assert_close(metrics["train/loss"], second)


def test_validation_deq_statistics_are_those_of_the_models_own_solve():
    # the exact-SM metric solves again through a cold unroll of max_iter Picard steps; the logged statistics must
    # be those of the model's loss (here Anderson, warm-started: far fewer iterations)
    deq = partial(DEQ, solver="anderson", tol=1e-6, max_iter=50, warm_start=True)
    module = build_module({"class_path": "deqscore.lightning.NICEModule", "init_args": {
        "net": {"class_path": "deqscore.models.NICE", "init_args": {
            "dim": 8, "n_couplings": 1, "m_net": "deq", "hidden": 6,
            "deq": {"class_path": "deqscore.deq.DEQ", "init_args": deq.keywords}}}}})
    x = torch.randn(4, 8)
    module.loss_terms(x)
    module.loss_terms(x)  # warm start: converged at once
    own = module.net.m_nets[0].deq.stats.nstep
    logged = {}
    module.log_stage = lambda stage, values, batch_size: logged.update(values)
    module.model_step(x, "val", 0)
    assert "exact_sm" in logged and logged["deq/nstep"] == own < 50
    assert module.net.m_nets[0].deq.stats.nstep != own  # the metric's own solve left different statistics


def test_hparams_rebuild_the_module_and_objects_are_not_stored():
    net = {"class_path": "deqscore.models.NICE", "init_args": {"dim": 4, "n_couplings": 1, "hidden": 5,
                                                               "n_layers": 2}}
    built = build_module({"class_path": "deqscore.lightning.NICEModule",
                          "init_args": {"net": net, "loss": {"class_path": "deqscore.losses.SSM",
                                                             "init_args": {"n_projections": 3}}}})
    assert type(built.loss) is SSM and built.loss.n_projections == 3
    again = build_module({"class_path": built.hparams["_class_path"],
                          "init_args": {k: v for k, v in built.hparams.items() if not k.startswith("_")}})
    assert again.hparams == built.hparams and again.loss.n_projections == 3
    # built in Python from objects: the loss is recorded as its config, the network (an object) is left out
    from deqscore.lightning import NICEModule

    module = NICEModule(net=NICE(dim=4, n_couplings=1, hidden=5, n_layers=2), loss=SSM(n_projections=2))
    assert "net" not in module.hparams
    assert module.hparams["loss"] == {"class_path": "deqscore.losses.objectives.SSM",
                                      "init_args": {"n_projections": 2, "projection": "rademacher"}}


def test_no_optimizer_configured_is_a_clear_error():
    with pytest.raises(ConfigError, match="no optimizer configured: give `optimizer:`"):
        TwoPartGaussian.__mro__[1].configure_optimizers(TwoPartGaussian())


def test_ift_with_a_second_order_loss_is_refused_at_construction():
    net = NICE(dim=4, n_couplings=1, m_net="deq", hidden=5, deq=partial(DEQ, backward="ift"))
    from deqscore.lightning import NICEModule

    with pytest.raises(ConfigError, match="backward='ift' cannot be used with the loss DSM"):
        NICEModule(net=net, loss="dsm")
    assert NICEModule(net=net, loss="mle").loss.input_derivatives == 0  # first-order: allowed
