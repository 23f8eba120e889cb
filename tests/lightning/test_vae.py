"""The VAE family in training: two optimisers, each touching only its own network; AIS at test time; the FID of
decoder samples from the callback and from sample.py."""

import json

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

import sample
from deqscore.cli.train import main
from deqscore.errors import ConfigError
from deqscore.lightning import VAEModule, load_module
from deqscore.lightning import vae as vae_module
from deqscore.lightning.callbacks import read_metrics_csv
from deqscore.metrics.ais import ais_log_likelihood
from deqscore.metrics.inception import InceptionFeatures
from deqscore.metrics.reference import image_stats, load_stats, stats_file
from deqscore.metrics.statistics import frechet_distance
from deqscore.models import ImplicitVAE

from .conftest import tiny_args


class StepRecorder(pl.Callback):
    """Parameters and gradients before every optimiser step, and the parameters at each batch's end."""

    def __init__(self):
        self.events = []  # (optimiser index or "end", {name: parameter}, {name: gradient or None})

    def _snapshot(self, module):
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
        return params, grads

    def on_before_optimizer_step(self, trainer, module, optimizer):
        index = next(i for i, o in enumerate(trainer.optimizers) if o is optimizer)
        self.events.append((index, *self._snapshot(module)))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.events.append(("end", *self._snapshot(module)))


@pytest.mark.parametrize("config", ["configs/vae/explicit_mnist.yaml", "configs/vae/deq_mnist.yaml"])
def test_each_optimiser_updates_only_its_own_network(tmp_path, config):
    cli = main(["fit", *tiny_args(tmp_path, config, "iso"), "--trainer.max_steps", "6", "--trainer.max_epochs", "1",
                f"--trainer.callbacks+={__name__}.StepRecorder", "--model.init_args.score_updates", "2"])
    recorder = next(c for c in cli.trainer.callbacks if isinstance(c, StepRecorder))
    module = cli.model
    score = {f"net.score.{n}" for n, _ in module.net.score.named_parameters()}
    ae = {n for n, _ in module.named_parameters()} - score
    ae_opt, score_opt = cli.trainer.optimizers
    # optimiser states hold only their own parameters
    names = {p: n for n, p in module.named_parameters()}
    assert {names[p] for p in ae_opt.state} == ae and {names[p] for p in score_opt.state} == score
    # per batch: score step, score step, encoder/decoder step (global_step counts all three)
    assert [e[0] for e in recorder.events] == [1, 1, 0, "end"] * 2 and cli.trainer.global_step == 6
    same = lambda g, h: (g is None and h is None) or (g is not None and h is not None and torch.equal(g, h))  # noqa: E731
    events = [(None, None, dict.fromkeys(ae | score)), *recorder.events]  # no gradients before the first step
    for prev, (index, before, grads), (_, after, _) in zip(events, events[1:], events[2:], strict=False):
        if index == "end":
            continue
        own, other = (score, ae) if index == 1 else (ae, score)
        # this optimiser's step changed its own parameters only
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        assert changed and changed <= own, (index, changed - own)
        # this optimiser's loss wrote no gradient into the other network: those are as the other's last step left them
        assert all(same(prev[2][n], grads[n]) for n in other), index


def _log_marginal_by_quadrature(decoder, x: torch.Tensor, nodes: int) -> torch.Tensor:
    """``log p(x) = log E_{z ~ N(0, I)} prod_i Bernoulli(x_i; sigmoid(decoder(z)_i))`` per row of binary ``x``, by
    Gauss-Hermite quadrature over the latent grid (written out here, independent of the model's likelihood)."""
    t, w = np.polynomial.hermite_e.hermegauss(nodes)  # weight exp(-t^2 / 2), weights summing to sqrt(2 pi)
    t, log_w = torch.tensor(t), torch.log(torch.tensor(w) / np.sqrt(2 * np.pi))
    d = decoder[0].in_features
    z = torch.cartesian_prod(*[t] * d).reshape(-1, d)
    log_wz = torch.cartesian_prod(*[log_w] * d).reshape(-1, d).sum(1)
    x = x.double()
    parts = []
    with torch.no_grad():
        for zc, lw in zip(z.split(8192), log_wz.split(8192), strict=True):
            logits = decoder(zc.float()).double()  # [n, 784]; log p(x | z) = x . logits - sum softplus(logits)
            parts.append(x @ logits.T - torch.nn.functional.softplus(logits).sum(1) + lw)
    return torch.logsumexp(torch.cat(parts, 1), 1)


def test_test_stage_logs_the_ais_log_likelihood(tmp_path, monkeypatch):
    seen = []  # the binarised images the module scores by AIS

    def recording_ais(log_lik, x, *args, **kwargs):
        seen.append(x.clone())
        return ais_log_likelihood(log_lik, x, *args, **kwargs)

    monkeypatch.setattr(vae_module, "ais_log_likelihood", recording_ais)
    cli = main(["fit", *tiny_args(tmp_path, "configs/vae/explicit_mnist.yaml", "ais"), "--trainer.max_steps", "3",
                "--trainer.max_epochs", "1", "--model.init_args.ais_steps", "200", "--model.init_args.ais_leapfrog",
                "5", "--model.init_args.ais_step_size", "0.1", "--model.init_args.ais_chains", "4"])
    seen.clear()  # validation's own small AIS estimates
    cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["test/score_ssm"]) and torch.isfinite(metrics["test/loss"])
    (x,) = seen  # one AIS batch (ais_batches 1)
    assert x.shape == (16, 784) and set(x.unique().tolist()) <= {0.0, 1.0}
    net = cli.model.net
    assert net.z_dim == 3
    # the exact log marginal of the trained decoder by quadrature over its 3-d latent (converged in the nodes)
    exact = _log_marginal_by_quadrature(net.decoder, x, 30)
    torch.testing.assert_close(exact, _log_marginal_by_quadrature(net.decoder, x, 20), rtol=0, atol=1e-3)
    # the logged value is the mean AIS estimate of log p(x): with 200 steps and 4 chains within a fraction of a nat,
    # less than the error of a prior counted twice or left out, or of a missing 1/chains normalisation (log 4)
    logged = metrics["test/ais_log_likelihood"].item()
    assert abs(logged - exact.mean().item()) < 0.5, (logged, exact.mean().item())


def test_binarisation_is_dynamic_and_rgb_pixels_are_dequantised():
    vae = ImplicitVAE(dim=784, z_dim=2, eps_dim=2, hidden=8, score="explicit")
    module = VAEModule(vae)
    x = torch.full((2000, 784), 0.3)
    torch.manual_seed(0)
    a, b = module.prepare_batch(x), module.prepare_batch(x)
    assert set(a.unique().tolist()) == {0.0, 1.0} and not torch.equal(a, b)
    assert abs(a.mean().item() - 0.3) < 0.005  # P(pixel = 1) = its grey level
    conv = VAEModule(ImplicitVAE(dim=3 * 32 * 32, channels=3, arch="conv", z_dim=2, eps_dim=2, nef=4,
                                 score="explicit"))
    assert conv.binarize is False
    y = torch.full((4, 3 * 32 * 32), 128 / 255)
    noise = conv.prepare_batch(y) - y
    assert noise.abs().max() <= 0.5 / 256 + 1e-7 and noise.std() > 0.5 / 256 / 3  # U(-1/2, 1/2) / 256


def test_ais_is_refused_for_the_gaussian_decoder():
    with pytest.raises(ConfigError, match="ais_batches"):
        VAEModule(ImplicitVAE(dim=3 * 32 * 32, channels=3, arch="conv", nef=4), ais_batches=1)


# the FID callback and sample.py's FID are tests/lightning/test_fid_callback.py's (an NCSN), and every family's
# sample_images tests/lightning/test_families.py's; this joins them through the VAE's decoder (35 s)
@pytest.mark.slow
def test_fid_of_decoder_samples_during_training_and_from_sample_script(tmp_path):
    n, reference = 6, 10
    key = {"dataset": "mnist", "split": "train", "resolution": "28x28", "count": reference}
    main(["fit", *tiny_args(tmp_path, "configs/vae/explicit_mnist.yaml", "fid"), "--trainer.max_epochs", "1",
          "--trainer.callbacks+=deqscore.lightning.FIDCallback",
          "--trainer.callbacks.num_samples", str(n), "--trainer.callbacks.reference_images", str(reference),
          "--trainer.callbacks.stats_root", str(tmp_path / "stats")])
    logged = read_metrics_csv(tmp_path / "fid" / "metrics.csv")["val/fid"][-1][1]
    ckpt = tmp_path / "fid" / "checkpoints" / "last.ckpt"
    module = load_module(ckpt).eval()
    torch.manual_seed(0)  # the callback's seed at epoch 0 on process 0
    reference_stats = load_stats(stats_file(key, tmp_path / "stats"), key)
    recomputed = frechet_distance(image_stats(module.sample_images(n), InceptionFeatures()), reference_stats)
    assert recomputed == pytest.approx(logged, rel=1e-4)
    sample.main(["--checkpoint", str(ckpt), "--num-samples", str(n), "--out", str(tmp_path / "s"), "--fid",
                 "--stats-root", str(tmp_path / "stats"), "--reference-images", str(reference)])
    report = json.loads((tmp_path / "s" / "fid.json").read_text())
    with np.load(tmp_path / "s" / "samples.npz") as data:
        images = torch.from_numpy(data["samples"])
    assert images.shape == (n, 1, 28, 28) and report["num_samples"] == n
    assert report["fid"] == pytest.approx(frechet_distance(image_stats(images, InceptionFeatures()), reference_stats),
                                          rel=1e-6)


def test_a_smoke_validation_skips_ais_and_a_real_one_runs_it(tmp_path, monkeypatch):
    """Lightning's sanity check before training and a fast_dev_run only check that the loop runs: the VAE skips
    their AIS (minutes on a CPU; nothing they log is kept or monitored). A real validation scores it."""
    calls = []

    def counting_ais(log_lik, x, *args, **kwargs):
        calls.append(x.shape[0])
        return ais_log_likelihood(log_lik, x, *args, **kwargs)

    monkeypatch.setattr(vae_module, "ais_log_likelihood", counting_ais)
    args = [*tiny_args(tmp_path, "configs/vae/explicit_mnist.yaml", "smoke"), "--trainer.max_steps", "3",
            "--trainer.num_sanity_val_steps", "1", "--trainer.val_check_interval", "100",
            "--trainer.check_val_every_n_epoch", "null"]
    cli = main(["fit", *args])
    assert calls == [] and cli.trainer.global_step == 3  # the sanity check ran without AIS, no validation after it
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    assert len(calls) == 1 and "val/ais_log_likelihood" in cli.trainer.callback_metrics
    main(["fit", *tiny_args(tmp_path, "configs/vae/explicit_mnist.yaml", "dev"), "--trainer.fast_dev_run", "true"])
    assert len(calls) == 1  # fast_dev_run's validation skipped it too
