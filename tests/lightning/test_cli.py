import csv
import hashlib
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from deqscore.cli.train import DeqscoreCLI, main, run
from deqscore.deq import DEQ
from deqscore.errors import ConfigError
from deqscore.lightning import CheckpointFamilyError, NonFiniteLossError, build_module, load_module
from deqscore.lightning.nice import NICE_LOSSES

from .conftest import FAMILY_TINY, ROOT, tiny_args

FAMILY_CONFIGS = [c for configs, _ in FAMILY_TINY.values() for c in configs]


@pytest.mark.parametrize("m_net", ["explicit", "deq"])
@pytest.mark.parametrize("loss", NICE_LOSSES)
def test_fast_dev_run_every_loss(m_net, loss, tmp_path, capsys):
    args = ["fit", *tiny_args(tmp_path), "--model.init_args.net.init_args.m_net", m_net,
            "--model.init_args.loss", loss, "--trainer.fast_dev_run", "1"]
    if m_net == "deq" and loss in ("kingma", "cp"):
        assert run(args) == 2
        assert "works only with net m_net='explicit'" in capsys.readouterr().err
        return
    cli = DeqscoreCLI(args=args[1:], run=False)
    before = {k: v.clone() for k, v in cli.model.state_dict().items()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and torch.isfinite(metrics["val/loss"])
    assert torch.isfinite(metrics["val/log_likelihood"]) and torch.isfinite(metrics["val/exact_sm"])
    changed = [k for k, v in cli.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "one training step must change the parameters"
    if m_net == "deq":
        assert metrics["train/deq/nstep"] >= 1 and metrics["train/deq/converged"] == 1


DEQ_KEY = "--model.init_args.net.init_args.deq.init_args"
USAGE_ERRORS = [  # (extra arguments, what the one-line message must say)
    (["--model.init_args.no_such_key", "1"], "model.init_args.no_such_key: NICEModule has no option 'no_such_key'"),
    (["--model.init_args.loss", "nce"],
     "model.init_args.loss: 'nce' is not accepted\n  accepted: 'exact', 'ssm', 'ssm_vr', 'dsm', 'mle', 'kingma', 'cp'"),
    ([f"{DEQ_KEY}.solver", "newton"], "unknown DEQ solver 'newton'; accepted: 'anderson', 'broyden'"),
    ([f"{DEQ_KEY}.backward", "adjoint"],
     "deq.init_args.backward: 'adjoint' is not accepted\n  accepted: 'phantom', 'unroll', 'ift', 'implicit'"),
    ([f"{DEQ_KEY}.tol", "-1"], "DEQ tol must be positive, got -1.0"),
    (["--model.init_args.loss", "deqscore.losses.SSM", "--model.init_args.loss.projection", "uniform"],
     "model.init_args.loss.projection: 'uniform' is not accepted\n  accepted: 'rademacher', 'gaussian', 'sphere'"),
    (["--model.init_args.loss", "ssm", "--model.init_args.loss.n_projections", "2"],
     "model.init_args.loss: cannot set n_projections='2' on a short"),
    (["--model.init_args.loss.n_projections", "2"],  # the loss left at the module's default
     "model.init_args.loss: cannot set n_projections='2' on a short name"),
    (["--model.init_args.net.init_args.hidden", "wide"],
     "net.init_args.hidden: 'wide' is not accepted\n  accepted: an int"),
    (["--optimizer", "Adamm"], "optimizer: 'Adamm' is not accepted\n  accepted: any torch.optim optimizer"),
    (["--data.init_args.transform", "sigmoid"],
     "data.init_args.transform: 'sigmoid' is not accepted\n  accepted: 'logit', 'unit', 'logit_squeeze'"),
    (["--trainer.inference_mode", "true"], "trainer.inference_mode must be false"),
    (["--optimizer.lr", "0"], "optimizer.init_args.lr must be a positive finite number, got 0.0"),
    (["--optimizer.lr", ".nan"], "optimizer.init_args.lr must be a positive finite number, got nan"),
    (["--ckpt_path", "missing.ckpt"], "ckpt_path: no checkpoint at missing.ckpt"),
    (["--config", "no/such/config.yaml"], "File does not exist"),
]


@pytest.mark.parametrize(("extra", "expected"), USAGE_ERRORS, ids=[" ".join(e[:2]) for e, _ in USAGE_ERRORS])
def test_usage_errors_are_one_message_without_traceback(tmp_path, capsys, extra, expected):
    assert run(["fit", *tiny_args(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and expected in err, err
    assert "Traceback" not in err and "usage:" not in err and len(err.splitlines()) <= 4, err
    assert not (tmp_path / "t").exists()  # nothing was written


def test_a_value_refused_inside_a_config_file_is_named_by_its_key(tmp_path, capsys):
    """The option at fault sits in a config file: the file's own values are tried one at a time."""
    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  init_args:\n    exact_sm_batches: 1\n    loss: nce\n")
    assert run(["fit", *tiny_args(tmp_path), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "error: model.init_args.loss: 'nce' is not accepted\n  accepted: 'exact', 'ssm'" in err, err


def test_a_misspelt_option_gets_the_close_names():
    from deqscore.cli.parser_errors import describe

    message = describe("trainer.max_stepz", "3", None)
    assert message.startswith("trainer.max_stepz: Trainer has no option 'max_stepz'\n  did you mean max_steps"), message


TRAINER_OPTION_ERRORS = [  # (option, a value out of its range, what the one line must say)
    ("max_steps", "-5", "trainer.max_steps must be -1 (no limit) or an int >= 0, got -5"),
    ("max_epochs", "-5", "trainer.max_epochs must be -1 (no limit) or an int >= 0, got -5"),
    ("accumulate_grad_batches", "0", "trainer.accumulate_grad_batches must be an int >= 1, got 0"),
    ("val_check_interval", "0", "trainer.val_check_interval must be an int >= 1 (batches), a float in (0, 1]"),
    ("val_check_interval", "1.5", "trainer.val_check_interval must be an int >= 1 (batches), a float in (0, 1]"),
    ("limit_train_batches", "-1", "trainer.limit_train_batches must be an int >= 0 or a float in [0, 1], got -1"),
    ("limit_val_batches", "1.5", "trainer.limit_val_batches must be an int >= 0 or a float in [0, 1], got 1.5"),
    ("limit_test_batches", "-2", "trainer.limit_test_batches must be an int >= 0 or a float in [0, 1], got -2"),
    ("limit_predict_batches", "-1", "trainer.limit_predict_batches must be an int >= 0 or a float in [0, 1]"),
    ("devices", "0", "trainer.devices must be 'auto', -1 (all), an int >= 1"),
    ("devices", "-2", "trainer.devices must be 'auto', -1 (all), an int >= 1"),
    ("num_nodes", "0", "trainer.num_nodes must be an int >= 1, got 0"),
    ("check_val_every_n_epoch", "0", "trainer.check_val_every_n_epoch must be an int >= 1 or null, got 0"),
    ("num_sanity_val_steps", "-3", "trainer.num_sanity_val_steps must be -1 (all) or an int >= 0, got -3"),
    ("gradient_clip_val", "-1", "trainer.gradient_clip_val must be a finite number >= 0, got -1"),
    ("accelerator", "gpu", "trainer: "),  # refused by Lightning's constructor here (no GPU): one line too
]


@pytest.mark.parametrize(("option", "value", "expected"), TRAINER_OPTION_ERRORS,
                         ids=[f"{o}={v}" for o, v, _ in TRAINER_OPTION_ERRORS])
def test_a_trainer_option_out_of_range_is_one_line_before_anything_is_written(tmp_path, capsys, option, value,
                                                                             expected):
    if option == "accelerator" and torch.cuda.is_available():
        pytest.skip("a GPU is there: the accelerator is accepted")
    assert run(["fit", *tiny_args(tmp_path), f"--trainer.{option}", value]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"error: {expected}" in lines[0], err
    assert not (tmp_path / "t").exists()  # checked before the run directory is made


def test_a_trainer_option_lightning_checks_against_the_data_is_one_line_and_blocks_nothing(tmp_path, capsys):
    # 3 training batches an epoch: validation every 1000 batches is refused when the fit starts (after the run
    # directory was made), one line all the same, and the directory is moved aside
    assert run(["fit", *tiny_args(tmp_path), "--trainer.val_check_interval", "1000"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error: " in line]
    assert len(lines) == 1 and "error: trainer: `val_check_interval` (1000) must be less than or equal" in lines[0]
    assert not (tmp_path / "t").exists() and (tmp_path / "t.failed-1").is_dir()


@pytest.mark.parametrize(("option", "value"), [("max_steps", "-1"), ("max_epochs", "-1"), ("limit_val_batches", "0"),
                                               ("limit_train_batches", "1.0"), ("val_check_interval", "2"),
                                               ("devices", "1"), ("accumulate_grad_batches", "2")])
def test_trainer_options_lightning_takes_are_accepted(option, value):
    from deqscore.cli.trainer_options import RULES

    parsed = {"-1": -1, "0": 0, "1.0": 1.0, "2": 2, "1": 1}[value]
    assert RULES[option][0](parsed)


def test_a_checkpoint_that_is_not_one_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    assert run(["fit", *tiny_args(tmp_path), "--ckpt_path", str(tmp_path / "junk.ckpt")]) == 2
    assert "junk.ckpt is not a readable PyTorch checkpoint" in capsys.readouterr().err


def _fit(tmp_path, run_name, epochs, extra=(), ckpt=None, config="configs/nice/explicit.yaml"):
    args = ["fit", *tiny_args(tmp_path, config, run_name), "--trainer.max_epochs", str(epochs), *extra]
    if ckpt:
        args += ["--ckpt_path", str(ckpt)]
    return main(args)


# Runs bounded by max_steps take a different resume path in Lightning than runs bounded by epochs only: both are
# covered (VAE configs set max_steps, the tiny NCSN and NICE ones do not; NICE is also run with it). A reference or
# deep-network config differs from its family's DEQ or explicit config in sizes and solver options alone, the same
# module, network class, data module and DEQ backward: its resume runs with the slow tests.
def _resume_case(config: Path):
    name = str(config.relative_to(ROOT / "configs"))
    same_as_another = config.stem.endswith("_reference") or "explicit_deep" in config.stem
    return pytest.param(config, (), id=name, marks=[pytest.mark.slow] if same_as_another else [])


RESUME_CASES = [_resume_case(c) for c in FAMILY_CONFIGS] + [
    pytest.param(ROOT / "configs/nice/deq.yaml", ("--trainer.max_steps", "1000"), id="nice/deq.yaml-max_steps")]


@pytest.mark.parametrize(("config", "extra"), RESUME_CASES)
def test_resume_continues_exactly(tmp_path, config, extra):
    straight = _fit(tmp_path, "straight", 2, extra, config=config)
    first = _fit(tmp_path, "resumed", 1, extra, config=config)
    run = tmp_path / "resumed"
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert "z_cache" not in "".join(ckpt["state_dict"])  # warm-start buffers are not saved
    # resume from nothing but the run directory: its saved config and checkpoint
    resumed = main(["fit", "--config", str(run / "config.yaml"), "--trainer.max_epochs", "2",
                    "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    assert resumed.trainer.global_step == straight.trainer.global_step == 2 * first.trainer.global_step
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    # bit for bit, DEQs too: their warm starts travel in the checkpoint, outside the state dict
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # every optimiser (the VAE has two) continues its state
    assert len(straight.trainer.optimizers) == len(resumed.trainer.optimizers)
    for opt_a, opt_b in zip(straight.trainer.optimizers, resumed.trainer.optimizers, strict=True):
        state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
        assert state_a.keys() == state_b.keys()
        for i in state_a:
            for key, value in state_a[i].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[i][key]))
    # the resumed run's CSV log keeps the first epoch's rows and continues them, every value as logged straight
    from deqscore.lightning.callbacks import read_metrics_csv

    losses = read_metrics_csv(run / "metrics.csv")["train/loss"]
    assert losses == read_metrics_csv(tmp_path / "straight" / "metrics.csv")["train/loss"]
    steps = [s for s, _ in losses]
    assert steps == sorted(set(steps)) and steps[0] == 0  # no batch logged twice by a replayed epoch end


def test_a_run_cut_mid_epoch_by_max_steps_keeps_its_last_step_and_extends_exactly(tmp_path):
    """A run stopped at max_steps in the middle of an epoch (8 batches an epoch here): last.ckpt holds its last
    step, and extended to a larger max_steps it trains the rest of that epoch and the next as an uninterrupted run
    does (Lightning would start the next epoch, and write last.ckpt only at the epoch's end)."""
    def fresh(name, steps):
        return ["fit", *tiny_args(tmp_path, "configs/nice/explicit.yaml", name), "--data.init_args.train_subset",
                "128", "--trainer.max_steps", str(steps)]

    def last(name):
        return torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)

    main(fresh("cut", 3))
    assert last("cut")["global_step"] == 3
    main(["fit", "--config", str(tmp_path / "cut" / "config.yaml"), "--trainer.max_steps", "10",
          "--ckpt_path", str(tmp_path / "cut" / "checkpoints" / "last.ckpt")])
    main(fresh("straight", 10))
    resumed, straight = last("cut"), last("straight")
    assert resumed["global_step"] == straight["global_step"] == 10  # the epoch's end was at 8
    for key, value in straight["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key


def _logged_rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in csv.DictReader(f)
                if r.get("train/loss") or r.get("val/loss")]


@pytest.mark.parametrize(("config", "every", "cut", "steps_per_batch"), [
    ("configs/nice/explicit.yaml", 2, 4, 1),  # last.ckpt written by a validation in the middle of an epoch
    ("configs/nice/explicit.yaml", 4, 8, 1),  # ... by a validation at an epoch's last batch (8 batches an epoch)
    ("configs/nice/deq.yaml", 2, 4, 1),  # a warm-starting DEQ: its starts are saved, and evaluations leave them
    ("configs/vae/deq_mnist.yaml", 2, 4, 3)])  # a batch: the score net's 2 updates, the VAE's 1
def test_a_run_resumed_from_a_checkpoint_written_by_a_validation_logs_as_an_uninterrupted_one(tmp_path, config,
                                                                                            every, cut,
                                                                                            steps_per_batch):
    """A validation at a batch's end writes ``last.ckpt`` before Lightning counts that batch as logged; the resume
    must keep that step's rows (training loss and validation) and log the rest at the uninterrupted run's steps."""
    def fresh(name, batches):
        return ["fit", *tiny_args(tmp_path, config, name), "--data.init_args.train_subset", "128",
                "--trainer.max_steps", str(batches * steps_per_batch), "--trainer.max_epochs", "-1",
                "--trainer.val_check_interval", str(every), "--trainer.check_val_every_n_epoch", "null"]

    main(fresh("cut", cut))
    main(["fit", "--config", str(tmp_path / "cut" / "config.yaml"), "--trainer.max_steps",
          str((cut + 4) * steps_per_batch), "--ckpt_path", str(tmp_path / "cut" / "checkpoints" / "last.ckpt")])
    main(fresh("straight", cut + 4))
    straight = _logged_rows(tmp_path / "straight")
    assert str(cut - 1) in {step for step, _, val in straight if val}  # a validation at the checkpoint's step
    assert len({step for step, loss, _ in straight if loss}) == cut + 4
    assert _logged_rows(tmp_path / "cut") == straight


def test_a_deq_trains_the_same_whenever_it_is_validated(tmp_path):
    """Validation starts its DEQ layers cold and hands the training's warm starts back: a warm-starting DEQ
    validated every 2 steps trains as the same run never validated, bit for bit (its solves too: their iteration
    counts and residuals, which a warm start from a validation batch would move)."""
    from deqscore.lightning.callbacks import read_metrics_csv

    def run(name, *extra):
        main(["fit", *tiny_args(tmp_path, "configs/nice/deq.yaml", name), "--data.init_args.train_subset", "128",
              "--trainer.max_steps", "6", "--trainer.max_epochs", "-1", *extra])
        log = read_metrics_csv(tmp_path / name / "metrics.csv")
        weights = torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
        return {k: log[k] for k in ("train/loss", "train/deq/nstep", "train/deq/abs_residual")}, weights

    validated, a = run("validated", "--trainer.val_check_interval", "2", "--trainer.check_val_every_n_epoch", "null")
    never, b = run("never", "--trainer.limit_val_batches", "0")
    assert len(validated["train/loss"]) == 6 and validated == never
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_written_during_an_evaluation_holds_the_trainings_warm_starts():
    """A save inside a validation (a Ctrl-C in its batch, a save on an exception) writes the warm starts the
    training left, not the validation's; a validation started again after one that failed keeps them too."""
    from types import SimpleNamespace

    from deqscore.deq import DEQ
    from deqscore.lightning.run_hooks import WARM_STARTS_KEY, TrainingWarmStarts

    from ..deq.helpers import TanhMap

    module = torch.nn.Module()
    module.deq = DEQ(TanhMap(4), solver="picard", tol=1e-10, max_iter=200, warm_start=True)
    trainer = SimpleNamespace(world_size=1, global_rank=0)
    module.deq(torch.randn(3, 4, dtype=torch.float64))
    training = module.deq.z_cache
    callback = TrainingWarmStarts()
    for _ in range(2):  # the second: a validation started again after one that never reached its end
        callback.on_validation_epoch_start(trainer, module)
        assert module.deq.z_cache is None  # the validation starts cold
        module.deq(torch.randn(3, 4, dtype=torch.float64))
        saved = {}
        callback.on_save_checkpoint(trainer, module, saved)
        assert torch.equal(saved[WARM_STARTS_KEY][0]["deq"]["z"], training)
    callback.on_validation_epoch_end(trainer, module)
    assert module.deq.z_cache is training
    # a DDP save from an exception's hooks may be one process's alone: no gather, the file is written without them
    assert TrainingWarmStarts._every_rank(SimpleNamespace(world_size=2, global_rank=0, interrupted=True), {}) is None
    # a resume takes its own rank's back; with another number of processes, or from a checkpoint without any, cold
    other = torch.ones(3, 4, dtype=torch.float64)
    for ranks, saved, expected in ((1, [{"deq": {"z": other}}], other), (2, [{"deq": {"z": other}}], None),
                                   (1, None, None)):
        module.deq.load_warm_starts({"z": training})
        callback.on_load_checkpoint(SimpleNamespace(world_size=ranks, global_rank=0), module, {WARM_STARTS_KEY: saved})
        assert module.deq.z_cache is expected


def test_a_checkpoint_without_a_recorded_log_step_reads_it_from_its_loop_state():
    """Checkpoints written before the log step was recorded: Lightning's count of stepping batches, plus the batch a
    save at a batch's end has not counted yet."""
    from deqscore.lightning.runs import LOG_STEP_KEY, checkpoint_log_step

    def saved(stepped, completed, processed):
        progress = {"ready": processed, "started": processed, "processed": processed, "completed": completed}
        return {"loops": {"fit_loop": {"epoch_loop.state_dict": {"_batches_that_stepped": stepped},
                                       "epoch_loop.batch_progress": {"total": progress}}}}

    assert checkpoint_log_step(saved(5, 5, 5)) == 5  # after the count
    assert checkpoint_log_step(saved(5, 5, 6)) == 6  # in a batch's end hooks
    assert checkpoint_log_step({**saved(5, 5, 5), LOG_STEP_KEY: 6}) == 6  # recorded: taken as it is


def _nice_module(loss="ssm", deq=None, **net):
    """A NICEModule built from its config (as the CLI does); ``deq``: DEQ options (a DEQ m-net)."""
    net = {"dim": 8, "hidden": 12, "n_layers": 3, "n_couplings": 2, **net}
    if deq is not None:
        net |= {"m_net": "deq", "deq": {"class_path": "deqscore.deq.DEQ", "init_args": deq}}
    return build_module({"class_path": "deqscore.lightning.NICEModule", "init_args": {
        "net": {"class_path": "deqscore.models.NICE", "init_args": net}, "loss": loss}})


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


class PoisonFromStep4(pl.Callback):
    """From global step 4 on, the model's output becomes NaN."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step >= 4:
            with torch.no_grad():
                module.net.log_scale[0] = float("nan")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    _fit(tmp_path, "nan", 1)
    last = tmp_path / "nan" / "checkpoints" / "last.ckpt"
    digest = _sha(last)
    args = ["fit", "--config", str(tmp_path / "nan" / "config.yaml"), "--trainer.max_epochs", "3",
            f"--trainer.callbacks+={__name__}.PoisonFromStep4", "--ckpt_path", str(last)]
    with pytest.raises(NonFiniteLossError, match="global step 4"):
        main(args)
    assert _sha(last) == digest
    state = torch.load(last, weights_only=False)["state_dict"]
    assert all(torch.isfinite(v).all() for v in state.values())


def test_sample_script_and_checkpoint_family(tmp_path, root):
    import numpy as np

    import sample

    _fit(tmp_path, "s", 1)
    ckpt = tmp_path / "s" / "checkpoints" / "last.ckpt"
    sample.main(["--checkpoint", str(ckpt), "--num-samples", "10", "--out", str(tmp_path / "out"), "--batch-size", "4"])
    arr = np.load(tmp_path / "out" / "samples.npz")["samples"]
    assert arr.shape == (10, 1, 28, 28) and (arr >= 0).all() and (arr <= 1).all()
    assert (tmp_path / "out" / "samples.png").stat().st_size > 0
    # the samples are the flow's inverse of N(0, I): mapping them back gives latents of unit variance
    module = load_module(ckpt)
    alpha = module.image_codec.alpha  # the run's logit_squeeze pipeline, undone by sample.py, redone here
    y = module.net(torch.logit(alpha + (1 - 2 * alpha) * torch.from_numpy(arr).view(10, -1)))
    assert 0.5 < y.std().item() < 1.5

    # a checkpoint of another family is refused with a clear message
    bad = torch.load(ckpt, weights_only=False)
    bad["deqscore_family"] = "ncsn"
    torch.save(bad, tmp_path / "other.ckpt")
    with pytest.raises(CheckpointFamilyError, match="ncsn"):
        load_module(tmp_path / "other.ckpt")
    with pytest.raises(CheckpointFamilyError, match="not 'nice'"):
        module.on_load_checkpoint(bad)
    with pytest.raises(FileNotFoundError):
        load_module(tmp_path / "missing.ckpt")
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable"):
        load_module(tmp_path / "junk.ckpt")


def test_ift_is_refused_for_score_losses_and_allowed_for_mle(tmp_path):
    with pytest.raises(ConfigError, match="backward='ift' cannot be used with the loss SSM"):
        _nice_module(loss="ssm", deq={"backward": "ift"})
    # MLE needs first derivatives only: IFT trains, and exact SM is still evaluated (through an unroll)
    args = ["fit", *tiny_args(tmp_path), f"{DEQ_KEY}.backward", "ift", "--model.init_args.loss", "mle",
            "--trainer.fast_dev_run", "1"]
    cli = main(args)
    assert torch.isfinite(cli.trainer.callback_metrics["val/exact_sm"])
    assert all(d.backward == "ift" for d in cli.model.deq_layers())


def test_training_improves_the_model_and_test_is_reproducible(tmp_path):
    cli = _fit(tmp_path, "learn", 4, ["--optimizer.lr", "3e-3", "--model.init_args.exact_sm_samples", "16"],
               config="configs/nice/deq.yaml")
    from deqscore.lightning.callbacks import read_metrics_csv

    run = tmp_path / "learn"
    series = read_metrics_csv(run / "metrics.csv")
    ll = [v for _, v in series["val/log_likelihood"]]
    sm = [v for _, v in series["val/exact_sm"]]
    assert ll[-1] > ll[0] and sm[-1] < sm[0], (ll, sm)  # SSM training lowers exact SM and raises likelihood
    assert (run / "samples.png").is_file() and (run / "curves.png").is_file()
    # logged once per run: parameter count and the activation memory of one training step
    assert [v for _, v in series["run/parameters"]] == [float(sum(p.numel() for p in cli.model.parameters()))]
    (memory,) = [v for _, v in series["run/activation_memory_mb"]]
    # the meter (tested against closed forms in tests/metrics) on a training batch of the module: what a phantom
    # DEQ records depends on shapes only, so the trained weights record what the first step's did
    from deqscore.lightning.run_hooks import batch_inputs
    from deqscore.metrics import step_activation_bytes

    module = cli.model.train()
    x = module.prepare_batch(batch_inputs(next(iter(cli.datamodule.train_dataloader()))))
    expected = step_activation_bytes(lambda: module.loss_terms(x)["loss"].backward(), module) / 2**20
    assert memory == pytest.approx(expected, rel=1e-6)
    ckpt = str(run / "checkpoints" / "last.ckpt")
    results = [main(["test", "--config", str(run / "config.yaml"), "--ckpt_path", ckpt]).trainer.callback_metrics
               for _ in range(2)]
    for key in ("test/log_likelihood", "test/bits_per_dim", "test/exact_sm", "test/loss"):
        assert torch.isfinite(results[0][key]) and results[0][key] == results[1][key], key
    assert cli.trainer.global_step == 4 * 3


def test_nonconverging_deq_warns_and_logs(tmp_path):
    from deqscore.deq import DEQConvergenceWarning

    args = ["fit", *tiny_args(tmp_path), f"{DEQ_KEY}.max_iter", "1", f"{DEQ_KEY}.tol", "1e-12",
            f"{DEQ_KEY}.warm_start", "false", "--trainer.fast_dev_run", "1"]
    with pytest.warns(DEQConvergenceWarning, match="did not converge in 1 iterations: abs residual"):
        cli = main(args)
    metrics = cli.trainer.callback_metrics
    assert metrics["train/deq/converged"] == 0 and metrics["train/deq/nstep"] == 1
    assert metrics["train/deq/abs_residual"] > 1e-12


def test_exact_sm_metric_is_the_converged_models_exact_sm():
    import copy

    torch.manual_seed(0)
    module = _nice_module(dim=8, n_couplings=2, hidden=6, deq_scale=0.9,
                          deq={"tol": 1e-12, "max_iter": 200, "warm_start": True, "phantom_steps": 1}).double()
    x = torch.randn(5, 8, dtype=torch.float64)
    module.net.log_prob(x)  # fills the warm-start cache with this very shape
    got = module.eval_metrics(x, "val", 0)["exact_sm"]
    # reference: dense per-sample Hessians of a copy re-attached by many phantom steps (an independent path)
    ref_net = copy.deepcopy(module.net)
    for deq in (m for m in ref_net.modules() if isinstance(m, DEQ)):
        deq.phantom_steps, deq.warm_start = 60, False
    values = []
    for b in range(5):
        f = lambda v: ref_net.log_prob(v[None])[0]  # noqa: E731
        g = torch.autograd.functional.jacobian(f, x[b])
        values.append(0.5 * g.pow(2).sum() + torch.autograd.functional.hessian(f, x[b]).trace())
    assert got.item() == pytest.approx(torch.stack(values).mean().item(), rel=1e-8)


def test_missing_data_is_a_usage_error_naming_what_to_put_where(tmp_path, capsys, monkeypatch):
    from deqscore.data import mnist

    def offline(root, train):
        raise mnist._Unavailable("network disabled in tests")

    monkeypatch.setattr(mnist, "_from_download", offline)
    monkeypatch.setattr(mnist, "find_pureml_mnist", lambda: None)
    args = ["fit", *tiny_args(tmp_path), "--data.init_args.data_dir", str(tmp_path / "empty"),
            "--trainer.fast_dev_run", "1"]
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "MNIST" in err and str(tmp_path / "empty") in err and "Traceback" not in err


def test_a_batch_larger_than_the_training_subset_is_a_usage_error(tmp_path, capsys):
    assert run(["fit", *tiny_args(tmp_path), "--data.init_args.batch_size", "64", "--trainer.max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: data.batch_size: 64 is more than the 48 training items" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_sample_script_reports_a_bad_checkpoint_in_one_message(tmp_path, capsys):
    import sample

    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    for path, expected in ((tmp_path / "missing.ckpt", "no checkpoint at"), (tmp_path / "junk.ckpt", "not a readable")):
        with pytest.raises(SystemExit) as info:
            sample.main(["--checkpoint", str(path), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "error: --checkpoint: " in err and expected in err and str(path) in err, err
        assert "Traceback" not in err and "usage:" not in err and not (tmp_path / "out").exists()


def test_nice_on_undequantised_pixels_is_a_usage_error(tmp_path, capsys):
    assert run(["fit", *tiny_args(tmp_path), "--data.init_args.transform", "pixels"]) == 2
    err = capsys.readouterr().err
    assert "data.init_args.transform: NICE models the density of dequantised images" in err
    assert "accepted: 'logit', 'unit', 'logit_squeeze'" in err
    assert "Traceback" not in err
    assert not (tmp_path / "t").exists()  # refused before anything is written


@pytest.mark.parametrize(("content", "what"), [("", "the file is empty"), ("- a\n- b\n", "the file is a YAML list")])
def test_a_config_file_that_is_not_a_mapping_is_named(tmp_path, capsys, content, what):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert run(["fit", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: {what}" in err and "Traceback" not in err and len(err.splitlines()) == 1


class RenamedDEQ(DEQ):
    """A user's own DEQ layer under another name."""


def test_deq_configs_are_recognised_by_their_class_not_their_name():
    from deqscore.cli.checkpoints import is_deq_config

    assert is_deq_config({"class_path": "deqscore.deq.DEQ"})
    assert is_deq_config({"class_path": f"{__name__}.RenamedDEQ"})
    assert not is_deq_config({"class_path": "torch.nn.Linear"})
    assert not is_deq_config({"class_path": "somewhere.else.DEQ"})  # a name alone is not a DEQ layer


def test_a_named_callbacks_option_reaches_that_callback_alone(tmp_path, capsys):
    """The configs name their callbacks (``ema``, ``checkpoint``): ``--trainer.callbacks.ema.init_args.X`` sets the
    EMA's option and nothing else; ``--trainer.callbacks.X`` of no name stays jsonargparse's (an option of the last
    callback listed)."""
    from pytorch_lightning.callbacks import EMAWeightAveraging, ModelCheckpoint

    config = "configs/ncsn/deq_mnist.yaml"
    cli = DeqscoreCLI(args=[*tiny_args(tmp_path, config), "--trainer.callbacks.ema.init_args.update_every_n_steps", "3",
                            "--trainer.callbacks.checkpoint.init_args.filename=x-{epoch}"], run=False)
    ema = next(c for c in cli.trainer.callbacks if isinstance(c, EMAWeightAveraging))
    assert ema.update_every_n_steps == 3
    assert any(isinstance(c, ModelCheckpoint) and c.filename == "x-{epoch}" for c in cli.trainer.callbacks)
    default = DeqscoreCLI(args=tiny_args(tmp_path, config), run=False)
    assert next(c for c in default.trainer.callbacks if isinstance(c, EMAWeightAveraging)).update_every_n_steps == 1
    before = DeqscoreCLI(args=["--trainer.callbacks.ema.init_args.update_every_n_steps", "5",  # before the config
                               *tiny_args(tmp_path, config)], run=False)
    assert next(c for c in before.trainer.callbacks if isinstance(c, EMAWeightAveraging)).update_every_n_steps == 5
    appended = DeqscoreCLI(args=[*tiny_args(tmp_path, config), "--trainer.callbacks+=LearningRateMonitor",
                                 "--trainer.callbacks.logging_interval=step"], run=False)
    monitor = next(c for c in appended.trainer.callbacks if type(c).__name__ == "LearningRateMonitor")
    assert monitor.logging_interval == "step"
