"""The NCSN family end to end on MNIST: EMA weights (the exponential average of the trained ones, used by
validation and stored as the checkpoint's weights), exact resume with the average, raw weights on request, and the
DEQ backward allowed by each annealed loss."""

import pytest
import torch
from pytorch_lightning import Callback

from deqscore.cli.train import main
from deqscore.deq import deq_backward
from deqscore.errors import ConfigError
from deqscore.lightning import build_module, load_module

from .conftest import tiny_args

DEQ_MNIST = "configs/ncsn/deq_mnist.yaml"
DECAY = 0.999  # the config's


class RecordWeights(Callback):
    """The trained weights after every optimiser step, and the weights validation runs with."""

    def __init__(self):
        self.after_step, self.in_validation = [], []

    @staticmethod
    def _flat(module):
        return torch.cat([p.detach().flatten().clone() for p in module.parameters()])

    def on_train_batch_end(self, trainer, module, *args):
        self.after_step.append(self._flat(module))

    def on_validation_batch_start(self, trainer, module, *args):
        if not trainer.sanity_checking:
            self.in_validation.append(self._flat(module))


def _fit(tmp_path, name: str, epochs: int, *extra: str) -> tuple:
    """Fit ``epochs`` epochs of 3 steps with a :class:`RecordWeights` callback; (cli, recorder)."""
    cli = main(["fit", *tiny_args(tmp_path, DEQ_MNIST, name), "--trainer.max_epochs", str(epochs),
                "--trainer.callbacks+=tests.lightning.test_ncsn.RecordWeights", *extra])
    return cli, next(c for c in cli.trainer.callbacks if isinstance(c, RecordWeights))


def _ema(weights, decay):
    avg = weights[0]
    for w in weights[1:]:
        avg = decay * avg + (1 - decay) * w
    return avg


def test_ema_is_the_exponential_average_used_by_validation_and_stored_in_checkpoints(tmp_path):
    cli, recorder = _fit(tmp_path, "ema", 2)
    assert len(recorder.after_step) == 6
    ema = _ema(recorder.after_step, DECAY)
    ckpt = torch.load(tmp_path / "ema" / "checkpoints" / "last.ckpt", weights_only=True)
    names = [n for n, _ in cli.model.named_parameters()]
    assert torch.allclose(torch.cat([ckpt["state_dict"][n].flatten() for n in names]), ema, atol=1e-6)
    assert torch.allclose(torch.cat([ckpt["current_model_state"][n].flatten() for n in names]),
                          recorder.after_step[-1], atol=0)
    # the second validation ran with the average of the six steps, not with the trained weights
    assert torch.allclose(recorder.in_validation[-1], ema, atol=1e-6)
    assert not torch.allclose(recorder.in_validation[-1], recorder.after_step[-1], atol=1e-4)
    # load_module gives the average; raw_weights the trained weights
    loaded = torch.cat([p.flatten() for p in load_module(tmp_path / "ema" / "checkpoints" / "last.ckpt").parameters()])
    raw = load_module(tmp_path / "ema" / "checkpoints" / "last.ckpt", raw_weights=True)
    assert torch.allclose(loaded, ema, atol=1e-6)
    assert torch.equal(torch.cat([p.flatten() for p in raw.parameters()]), recorder.after_step[-1])


def test_a_checkpoint_saved_after_fit_keeps_the_trained_weights_beside_the_average(tmp_path):
    """Fit's end puts the average into the module (what the end-of-fit grids and FID draw from); a checkpoint saved
    then still holds the last step's trained weights as its trained weights, and the average as its weights."""
    cli, recorder = _fit(tmp_path, "after", 2)
    after_fit = tmp_path / "after" / "checkpoints" / "after_fit.ckpt"
    cli.trainer.save_checkpoint(after_fit)
    flat = lambda module: torch.cat([p.flatten() for p in module.parameters()])  # noqa: E731
    assert torch.equal(flat(load_module(after_fit, raw_weights=True)), recorder.after_step[-1])
    assert torch.allclose(flat(load_module(after_fit)), _ema(recorder.after_step, DECAY), atol=1e-6)


def test_trained_weights_are_refused_where_a_checkpoint_holds_the_average_in_their_place(tmp_path, capsys):
    """What Lightning's own averaging callback saves after fit: the average as the weights and as the trained
    weights. Asked for the trained weights, load_module and sample.py say so in one line; the average still loads."""
    from deqscore.cli.sample import main as sample

    _fit(tmp_path, "ema", 2)
    checkpoint = torch.load(tmp_path / "ema" / "checkpoints" / "last.ckpt", weights_only=False)
    checkpoint["current_model_state"] = dict(checkpoint["state_dict"])
    average_twice = tmp_path / "average_twice.ckpt"
    torch.save(checkpoint, average_twice)
    with pytest.raises(ConfigError, match="keeps no trained weights"):
        load_module(average_twice, raw_weights=True)
    assert load_module(average_twice) is not None
    with pytest.raises(SystemExit) as stopped:
        sample(["--checkpoint", str(average_twice), "--num-samples", "2", "--out", str(tmp_path / "s"),
                "--raw-weights"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and "keeps no trained weights" in err, err


def test_resume_continues_the_average_exactly(tmp_path):
    _, straight = _fit(tmp_path, "straight", 3)
    _fit(tmp_path, "split", 1)
    _, resumed = _fit(tmp_path, "split", 3, "--ckpt_path", str(tmp_path / "split" / "checkpoints" / "last.ckpt"))
    assert torch.equal(resumed.after_step[-1], straight.after_step[-1])
    a, b = (torch.load(tmp_path / r / "checkpoints" / "last.ckpt", weights_only=True) for r in ("straight", "split"))
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert torch.equal(a["averaging_state"]["n_averaged"], b["averaging_state"]["n_averaged"])


def _module(loss, backward, dim=64, **deq_options):
    return build_module({"class_path": "deqscore.lightning.NCSNModule", "init_args": {
        "net": {"class_path": "deqscore.models.NCSN", "init_args": {
            "dim": dim, "channels": 1, "ngf": 4, "body": "deq",
            "deq": {"class_path": "deqscore.deq.DEQ", "init_args": {"backward": backward, **deq_options}}}},
        "loss": loss, "sigma_max": 1.0, "sigma_min": 0.1, "n_levels": 3}})


@pytest.mark.parametrize("loss", ["annealed_dsm", "annealed_fd_ssm"])
def test_first_order_losses_accept_ift(loss):
    """The IFT parameter gradients of a first-order loss equal those of every Picard iteration unrolled to
    convergence (the derivative of the converged layer), in float64."""
    torch.manual_seed(0)
    module = _module(loss, "ift", dim=16, solver="anderson", tol=1e-12, max_iter=300, ift_tol=1e-13, ift_max_iter=1000,
                     warn_on_nonconvergence=False).double()
    deq = module.net.body.deq
    assert deq.backward == "ift"
    x = torch.rand(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    params = [p for _, p in module.named_parameters()]

    def gradients():
        torch.manual_seed(2)  # the same noise levels and noise for both
        return torch.autograd.grad(module.compute_loss(x).mean(), params)

    ift = gradients()
    assert deq.stats.converged
    deq.max_iter, deq.tol = 2000, 1e-14
    with deq_backward(module, "unroll"):
        unrolled = gradients()
        assert deq.stats.solver == "picard" and deq.stats.converged, deq.stats.nstep
    func = {id(p) for p in deq.func.parameters()}
    assert any(id(p) in func and g.abs().max() > 1e-4 for p, g in zip(params, ift, strict=True))
    for g, h in zip(ift, unrolled, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-7, atol=1e-10)


def test_ssm_vr_refuses_ift_naming_the_fix():
    with pytest.raises(ConfigError, match="phantom"):
        _module("annealed_ssm_vr", "ift")
    assert _module("annealed_ssm_vr", "phantom").loss.input_derivatives == 1


@pytest.mark.parametrize(("kw", "match"), [
    ({"schedule": "cosine"}, "schedule"), ({"sigma_max": 0.01, "sigma_min": 0.1}, "decrease"),
    ({"n_levels": 1}, "n_levels"), ({"loss": "dsm"}, "loss"),
])
def test_bad_schedule_and_loss_options_are_config_errors(kw, match):
    config = {"net": {"class_path": "deqscore.models.NCSN", "init_args": {"dim": 64, "channels": 1, "ngf": 4,
                                                                           "body": "shallow"}}} | kw
    with pytest.raises(ConfigError, match=match):
        build_module({"class_path": "deqscore.lightning.NCSNModule", "init_args": config})


def test_dsm_every_level_has_the_closed_form_of_the_exact_score():
    """Data N(0, I): the smoothed density's score -x/(1 + sigma^2) gives E 0.5 ||sigma s + eps||^2 =
    D / (2 (1 + sigma^2)) at each level; 20,000 samples put the estimate within 4 standard errors."""
    from deqscore.losses import dsm_every_level

    sigmas, dim, n = torch.tensor([2.0, 0.5, 0.1]), 8, 20_000
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    losses = dsm_every_level(lambda y, s: -y / (1 + s[:, None] ** 2), x, sigmas, torch.Generator().manual_seed(1))
    assert losses.shape == (n, 3)
    expected = dim / (2 * (1 + sigmas.double() ** 2))
    stderr = losses.std(dim=0) / n**0.5
    assert ((losses.mean(dim=0) - expected).abs() < 4 * stderr).all(), (losses.mean(dim=0), expected)
    wrong = dsm_every_level(lambda y, s: 0 * y, x, sigmas, torch.Generator().manual_seed(1))  # D / 2 at every level
    assert ((wrong.mean(dim=0) - expected).abs() > 10 * stderr)[:2].all()


def test_the_every_level_test_figure_is_fixed_by_the_batch_and_only_in_test():
    module = build_module({"class_path": "deqscore.lightning.NCSNModule", "init_args": {
        "net": {"class_path": "deqscore.models.NCSN", "init_args": {"dim": 64, "channels": 1, "ngf": 4,
                                                                       "body": "shallow"}},
        "sigma_max": 1.0, "sigma_min": 0.1, "n_levels": 3, "test_every_level": True}})
    x = torch.rand(5, 64, generator=torch.Generator().manual_seed(0))
    first, again = module.eval_metrics(x, "test", 3), module.eval_metrics(x, "test", 3)
    assert set(first) == {"dsm_every_level", "dsm_every_level_sq", "dsm_level_0", "dsm_level_1", "dsm_level_2"}
    assert all(torch.equal(first[k], again[k]) for k in first)
    levels = torch.stack([first[f"dsm_level_{i}"] for i in range(3)])
    torch.testing.assert_close(first["dsm_every_level"], levels.mean())
    assert not torch.equal(module.eval_metrics(x, "test", 4)["dsm_every_level"], first["dsm_every_level"])
    assert module.eval_metrics(x, "val", 3) == {}


def test_sampling_cost_counts_every_langevin_evaluation_cold_and_warm():
    """3 levels x 4 steps + the final denoising step = 13 evaluations per sample; a warm start takes fewer solver
    iterations than a cold one on the same chain (same seed, so the same noise until the solves differ)."""
    module = _module("annealed_dsm", "phantom", solver="anderson", tol=1e-6, max_iter=60)
    module.sampler.n_steps_each, module.sampler.progress = 4, False
    cost = module.sampling_cost(n=3, seed=0)
    assert cost["evaluations_per_sample"] == 3 * 4 + 1
    for start in ("cold", "warm"):
        assert 1 <= cost[f"iterations_per_evaluation_{start}"] <= 60
        assert cost[f"iterations_per_sample_{start}"] == pytest.approx(13 * cost[f"iterations_per_evaluation_{start}"])
    assert cost["iterations_per_evaluation_warm"] < cost["iterations_per_evaluation_cold"]
    assert module.net.training and all(d.z_cache is None for d in module.deq_layers())  # sampling restores both


def test_train_py_test_scores_the_trained_weights_with_trained_weights_and_the_average_without(tmp_path):
    """With EMA, a checkpoint's state_dict is the average; TrainedWeights makes train.py test score the trained
    weights. Checked against the held-out figure computed directly from load_module's two sets of weights."""
    from deqscore.lightning.run_hooks import batch_inputs
    from deqscore.losses import dsm_every_level

    cli, _ = _fit(tmp_path, "ema", 2)
    ckpt = str(tmp_path / "ema" / "checkpoints" / "last.ckpt")

    def tested(*extra):
        test = main(["test", *tiny_args(tmp_path, DEQ_MNIST, "ema"), "--ckpt_path", ckpt,
                     "--model.init_args.test_every_level=true", *extra])
        return float(test.trainer.callback_metrics["test/dsm_every_level"]), test.datamodule

    def direct(datamodule, raw):
        module = load_module(ckpt, raw_weights=raw).eval()
        losses = [dsm_every_level(module.net, batch_inputs(b), module.sigmas, torch.Generator().manual_seed(i))
                  for i, b in enumerate(datamodule.test_dataloader())]
        with torch.no_grad():
            return float(torch.cat([loss.mean(dim=1) for loss in losses]).mean())

    trained, datamodule = tested("--trainer.callbacks+=deqscore.lightning.TrainedWeights")
    averaged, _ = tested()
    assert trained != averaged
    assert trained == pytest.approx(direct(datamodule, raw=True), rel=1e-5)
    assert averaged == pytest.approx(direct(datamodule, raw=False), rel=1e-5)
