"""GPU-ready training steps, checked on a CPU: every family's DEQ config trains under bf16-mixed; the fast
configuration (``SyncFreeSteps``, DEQ ``check_every``) makes at most one host sync of deqscore's own per step,
trains as the default configuration does, and still stops a non-finite step before it reaches the weights."""

import warnings

import pytest
import pytorch_lightning as pl
import torch

from deqlab.sync import HostSyncCounter, StepWindows, _extra_callback, fast_args, per_step
from deqscore.cli.train import main
from deqscore.lightning import NonFiniteLossError
from deqscore.lightning.run_hooks import SyncFreeSteps
from tests.lightning.conftest import ROOT, tiny_args

DEQ_CONFIGS = ["nice/deq.yaml", "dkef/deq.yaml", "ncsn/deq_mnist.yaml", "vae/deq_mnist.yaml"]
STEPS = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "6", "--data.init_args.batch_size", "8",
         "--trainer.limit_val_batches", "1"]


def _fit(tmp_path, config, *extra, name="r", callbacks=()):
    with warnings.catch_warnings(), _extra_callbacks(callbacks):
        warnings.simplefilter("ignore")  # tiny runs: non-convergence and loader warnings
        return main(["fit", *tiny_args(tmp_path, ROOT / "configs" / config, name), *extra])


def _extra_callbacks(callbacks):
    from contextlib import ExitStack

    stack = ExitStack()
    for c in callbacks:
        stack.enter_context(_extra_callback(c))
    return stack


@pytest.mark.parametrize("config", DEQ_CONFIGS)
def test_bf16_mixed_trains_every_familys_deq_config(config, tmp_path):
    cli = _fit(tmp_path, config, "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "2",
               "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "1")
    assert cli.trainer.global_step >= 2
    losses = [v for k, v in cli.trainer.callback_metrics.items() if k.startswith("train/loss")]
    assert losses and all(torch.isfinite(v) for v in losses)
    assert all(torch.isfinite(p).all() for p in cli.model.parameters())


class Losses(pl.Callback):
    """The training loss of every step, read after the step (in the test, not in the step)."""

    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


DEQ = "--model.init_args.net.init_args.deq.init_args"
FAST = {  # family: config, DEQ iteration counts of the fast configuration (fixed, check_every 0)
    "nice": ("nice/deq.yaml", {"max_iter": 10}),
    "ncsn": ("ncsn/deq_mnist.yaml", {"max_iter": 8, "ift_max_iter": 8}),
}


def _caps(iters):
    return [x for k, v in iters.items() for x in (f"{DEQ}.{k}", str(v))]


@pytest.mark.parametrize("family", sorted(FAST))
def test_fast_configuration_makes_at_most_one_host_sync_per_step(family, tmp_path):
    config, iters = FAST[family]
    counts = {}
    for name, extra in (("default", []), ("fast", fast_args(**iters))):
        counter = HostSyncCounter()
        windows = StepWindows(counter)
        with counter:
            _fit(tmp_path, config, *STEPS, "--trainer.max_steps", "5", *extra, name=name, callbacks=[windows])
        counts[name] = per_step(counter, windows.times)
        counts[name]["sites"] = counter.sites("deqscore")
    assert counts["fast"]["steps"] >= 3
    assert counts["fast"]["deqscore_syncs_max"] <= 1, counts["fast"]["sites"]
    # the count sees the default configuration's syncs (solver monitoring, guards): it is not blind
    assert counts["default"]["deqscore_syncs_mean"] > 5, counts["default"]["sites"]


def _train(tmp_path, family, name, extra, steps=3):
    config, _ = FAST[family]
    losses = Losses()
    cli = _fit(tmp_path, config, *STEPS, "--trainer.max_steps", str(steps), *extra, name=name, callbacks=[losses])
    return losses.values, {k: v.detach().clone() for k, v in cli.model.state_dict().items()}


@pytest.mark.parametrize("family", sorted(FAST))
def test_fast_configuration_trains_as_the_default_one_with_the_same_iterations(family, tmp_path):
    _, iters = FAST[family]
    never = [f"{DEQ}.tol", "1e-30", f"{DEQ}.ift_tol", "1e-30"]  # tolerances never met: the same iterations in both
    l_def, p_def = _train(tmp_path, family, "default", [*never, *_caps(iters)])
    l_fast, p_fast = _train(tmp_path, family, "fast", [*never, *fast_args(**iters)])
    assert len(l_def) == len(l_fast) == 3
    assert l_fast == pytest.approx(l_def, rel=1e-6)
    assert all(torch.allclose(p_fast[k], p_def[k], rtol=1e-5, atol=1e-7) for k in p_def)


def test_fast_configuration_checked_every_k_iterations_stays_within_the_solvers_tolerance(tmp_path):
    # check_every 3 may run up to 2 iterations past the one that met tol: the fixed points differ by at most
    # ~tol / (1 - a) (a = 0.5, tol 1e-5 in the tiny NICE), far below these bounds
    l_def, p_def = _train(tmp_path, "nice", "default", [])
    l_k3, p_k3 = _train(tmp_path, "nice", "k3", [f"{DEQ}.check_every", "3",
                                                 "--trainer.callbacks+=deqscore.lightning.run_hooks.SyncFreeSteps"])
    assert l_k3 == pytest.approx(l_def, rel=1e-4)
    assert all(torch.allclose(p_k3[k], p_def[k], rtol=0, atol=1e-5) for k in p_def)


class Poison(pl.Callback):
    """At global step ``step`` (and after): a NaN in the loss, the gradient of one parameter, or the input."""

    def __init__(self, where, step=2):
        self.where, self.step, self.before = where, step, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step < self.step:
            return
        self.module, self.before = module, {k: v.detach().clone() for k, v in module.state_dict().items()}
        if self.where == "loss":
            with torch.no_grad():
                module.net.log_scale[0] = float("nan")
        elif self.where == "gradient":
            module.net.log_scale.register_hook(lambda g: g * float("nan"))
        else:
            x = batch[0] if isinstance(batch, list | tuple) else batch
            x.view(-1)[0] = float("nan")


@pytest.mark.parametrize(("where", "named"), [("loss", "train loss"), ("gradient", "gradient of net.log_scale"),
                                              ("input", "NICE input")])
def test_a_non_finite_fast_step_stops_before_the_update(where, named, tmp_path):
    poison = Poison(where)
    with pytest.raises(NonFiniteLossError, match=f"{named}.*global step 2"):
        _fit(tmp_path, "nice/deq.yaml", *STEPS, "--trainer.max_steps", "5", *fast_args(max_iter=10),
             callbacks=[poison])
    after = poison.module.state_dict()
    poisoned = {"net.log_scale"} if where == "loss" else set()
    assert all(torch.equal(after[k], v) for k, v in poison.before.items() if k not in poisoned)  # no update


def test_sync_free_steps_is_switched_on_by_its_callback_only(tmp_path):
    cli = _fit(tmp_path, "nice/deq.yaml", *STEPS, "--trainer.max_steps", "1", *fast_args(max_iter=10))
    assert any(isinstance(c, SyncFreeSteps) for c in cli.trainer.callbacks)
    assert cli.model.sync_free_steps is False  # off again after the run (teardown)
