"""The DKEF family end to end: two-stage training lowers the validation loss on RedWine, the alpha of every loss
weighting minimises that loss, the final stage tunes log_lambda and saves final.ckpt, and highdim reports the truth."""

import math
import warnings

import pytest
import torch

from deqscore.cli.train import main
from deqscore.lightning import build_module
from deqscore.lightning import dkef as dkef_module
from deqscore.lightning.callbacks import read_metrics_csv
from deqscore.lightning.dkef import FINAL_STAGE_SEED
from deqscore.models.dkef import effective_sample_size

from .conftest import tiny_args

SHALLOW = "configs/dkef/explicit_shallow.yaml"


def test_a_short_fit_on_redwine_lowers_the_validation_loss(tmp_path):
    cli = main(["fit", *tiny_args(tmp_path, SHALLOW, "red"), "--trainer.max_epochs", "4",
                "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "3",
                "--model.init_args.net.init_args.n_centres", "40", "--model.init_args.alpha_points", "200"])
    val = [v for _, v in read_metrics_csv(tmp_path / "red" / "metrics.csv")["val/loss"]]
    assert len(val) == 4 and val[-1] < val[0], val
    assert cli.model.net.dim == 11  # linked from the data module
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["val/log_likelihood"])
    # reported in the data's units: the whitened figure plus the whitening's log |det W| (12.04 on RedWine)
    jacobian = float(metrics["val/log_likelihood"] - metrics["val/log_likelihood_whitened"])
    assert jacobian == pytest.approx(cli.datamodule.log_det_whitening, abs=1e-4) and jacobian > 12
    # the reported standard error of log Z is the spread of independent estimates of the same size (within the
    # sampling error of a spread from 12 estimates, and of the delta method)
    n = 2000  # the tiny runs' log_z_samples
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-sample warnings of the estimator
        estimates = [cli.model.net.log_partition(n_samples=n, chunk=500, generator=torch.Generator().manual_seed(s))[0]
                     for s in range(12)]
    spread = float(torch.tensor(estimates).std())
    assert 0.4 < float(metrics["val/log_z_stderr"]) / spread < 2.5, (float(metrics["val/log_z_stderr"]), spread)
    # the logged effective sample size: the validation estimate's n draws (the inverse formula is checked against
    # explicit weights in tests/models/test_dkef.py)
    ess = effective_sample_size(float(metrics["val/log_z_stderr"]), n)
    assert float(metrics["val/log_z_ess"]) == pytest.approx(ess, rel=1e-5) and 1 < ess < n


@pytest.mark.parametrize("weighting", ["none", "sigma2", "sigma4"])
def test_dsm_alpha_minimises_the_loss_it_trains_with_each_weighting(weighting):
    torch.manual_seed(0)
    module = build_module({"class_path": "deqscore.lightning.DKEFModule", "init_args": {
        "net": {"class_path": "deqscore.models.DKEF", "init_args": {
            "dim": 3, "n_centres": 6, "hidden": 5, "feature_net": "shallow"}},
        "loss": {"class_path": "deqscore.losses.DSM", "init_args": {"sigma": 0.3, "weighting": weighting}}}})
    module = module.double()
    x = torch.randn(40, 3, dtype=torch.float64)
    module.net.init_centres(x)
    torch.manual_seed(1)  # the solve and the loss draw the same noise
    alpha = module.net.solve_alpha(x, create_graph=False, **module.alpha_kwargs).detach().requires_grad_(True)
    torch.manual_seed(1)
    ridge = 0.5 * 10 ** module.net.log_lambda.detach() * alpha.pow(2).sum()
    objective = module.loss(module.score_with(alpha), x).mean() + ridge
    (grad,) = torch.autograd.grad(objective, alpha)
    assert grad.abs().max() < 1e-8 * (1 + alpha.abs().max())


def test_final_stage_tunes_log_lambda_and_saves_the_result(tmp_path):
    main(["fit", *tiny_args(tmp_path, SHALLOW, "fin"), "--trainer.max_epochs", "1",
          "--model.init_args.final_lambda_steps", "20", "--model.init_args.final_lambda_lr", "0.05"])
    ckpts = tmp_path / "fin" / "checkpoints"
    best = torch.load(next(ckpts.glob("best-*.ckpt")), weights_only=True)["state_dict"]
    final = torch.load(ckpts / "final.ckpt", weights_only=True)["state_dict"]
    assert final["net.log_lambda"] != best["net.log_lambda"]  # tuned
    tuned = {k: v for k, v in final.items() if k not in ("net.log_lambda", "net.alpha")}
    assert all(torch.equal(v, best[k]) for k, v in tuned.items())  # everything else is the best model's
    from deqscore.lightning import load_module

    module = load_module(ckpts / "final.ckpt")
    cli = main(["test", "--config", str(tmp_path / "fin" / "config.yaml"), "--ckpt_path", str(ckpts / "final.ckpt")])
    train = cli.datamodule.train_data
    with torch.random.fork_rng(), torch.enable_grad():
        torch.manual_seed(FINAL_STAGE_SEED)  # the final stage's projections
        g, b = module.net.alpha_system(train, create_graph=False, **module.alpha_kwargs)
    expected = module.net.alpha_from_system(g.detach(), b.detach(), differentiable=False)
    assert torch.allclose(module.net.alpha, expected, rtol=1e-3, atol=1e-5)  # alpha of the whole training set
    assert torch.isfinite(cli.trainer.callback_metrics["test/log_likelihood"])


def test_highdim_reports_the_fisher_divergence_and_the_true_likelihood(tmp_path):
    cli = main(["fit", *tiny_args(tmp_path, SHALLOW, "hd"), "--data.init_args.dataset", "highdim",
                "--data.init_args.dim", "5", "--trainer.fast_dev_run", "1"])
    assert cli.model.net.dim == 5
    metrics = cli.trainer.callback_metrics
    x = cli.datamodule.val_data[:16]  # the one validation batch of fast_dev_run
    true_ll = (-0.5 * x.pow(2).sum(1) - 2.5 * math.log(2 * math.pi)).mean()
    assert metrics["val/true_log_likelihood"].item() == pytest.approx(true_ll.item(), rel=1e-5)
    xg = x.clone().requires_grad_(True)
    fisher = 0.5 * (cli.model.net.score(xg).detach() + x).pow(2).sum(1).mean()
    assert metrics["val/fisher_divergence"].item() == pytest.approx(fisher.item(), rel=1e-3)


@pytest.mark.parametrize("dataset", ["redwine", "whitewine", "parkinsons", "highdim"])
@pytest.mark.parametrize("config", ["deq", "explicit_shallow", "explicit_deep"])
def test_every_config_runs_on_every_dataset(tmp_path, config, dataset):
    dim = ["--data.init_args.dim", "6"] if dataset == "highdim" else []  # the real data sets' is their file's
    cli = main(["fit", *tiny_args(tmp_path, f"configs/dkef/{config}.yaml", "d"), "--data.init_args.dataset", dataset,
                *dim, "--trainer.fast_dev_run", "1"])
    metrics = cli.trainer.callback_metrics
    assert cli.model.net.dim == cli.datamodule.dim == {"redwine": 11, "whitewine": 11, "parkinsons": 15,
                                                       "highdim": 6}[dataset]
    assert torch.isfinite(metrics["train/loss"]) and torch.isfinite(metrics["val/exact_sm"])
    assert ("val/fisher_divergence" in metrics) == (dataset == "highdim")


def test_the_stored_alpha_minimises_the_reported_loss_of_a_deq_feature_net():
    # the reported figures take the converged model's derivatives (unroll); the stored alpha must minimise exactly
    # that loss, not the phantom-derivative one of training (they differ by the K-step truncation)
    from types import SimpleNamespace

    from deqscore.deq import deq_backward

    torch.manual_seed(0)
    module = build_module({"class_path": "deqscore.lightning.DKEFModule", "init_args": {
        "net": {"class_path": "deqscore.models.DKEF", "init_args": {
            "dim": 3, "n_centres": 6, "hidden": 5, "feature_net": "deq",
            "deq": {"class_path": "deqscore.deq.DEQ", "init_args": {"solver": "picard", "tol": 1e-12,
                                                                     "max_iter": 300, "phantom_steps": 1}}}},
        "loss": "exact", "alpha_points": 40}}).double()
    points = torch.randn(40, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    module.net.init_centres(points)
    module.datamodule = lambda: SimpleNamespace(train_subset=lambda n, generator: points)
    module._refresh_alpha(seed=0)
    alpha = module.net.alpha.clone().requires_grad_(True)
    lam = 10 ** module.net.log_lambda.detach()

    def stationarity(mode):
        with deq_backward(module.net, mode):
            objective = module.loss(module.score_with(alpha), points).mean() + 0.5 * lam * alpha.pow(2).sum()
        (grad,) = torch.autograd.grad(objective, alpha)
        return float(grad.abs().max() / alpha.abs().max())

    assert stationarity("unroll") < 1e-8
    assert stationarity("phantom") > 1e-5  # the other derivatives would give another alpha


def test_an_unknown_log_z_proposal_is_refused_with_the_choices():
    from deqscore.errors import ConfigError
    from deqscore.models import DKEF

    with pytest.raises(ConfigError, match="log_z_proposal: expected one of gaussian, mixture, got 'kde'"):
        dkef_module.DKEFModule(DKEF(dim=3, n_centres=4, hidden=5), log_z_proposal="kde")
    with pytest.raises(ConfigError, match="(?s)log_z_proposal.*'gaussian', 'mixture'.*kde"):  # from a config
        build_module({"class_path": "deqscore.lightning.DKEFModule", "init_args": {
            "net": {"class_path": "deqscore.models.DKEF", "init_args": {"dim": 3, "n_centres": 4, "hidden": 5}},
            "log_z_proposal": "kde"}})
