"""Tests that follow the registries: every registered family's configs parse, build, train two steps with the
recorded losses (config_losses.py), save a checkpoint that rebuilds the module alone, and sample images through
the data module's transform."""

import pytest
import torch
import yaml
from pytorch_lightning.callbacks import ModelCheckpoint

from deqscore.cli.train import DeqscoreCLI, main
from deqscore.configfiles import load_config
from deqscore.data.transforms import ImageCodec
from deqscore.deq import DEQ
from deqscore.families import net_options
from deqscore.lightning import ScoreModule, family_registry, load_module

from .config_losses import TWO_STEPS, logged_training, recorded
from .conftest import CONFIGS, FAMILY_TINY, ROOT, family_of, tiny_args

RECORDED_LOSSES = recorded()
# the DEQ's mean iterations per solve and share of converged layers move in whole steps where a residual crosses
# the tolerance; a loss by rounding, relatively or (a difference of nearly equal terms) absolutely: up to 2e-5 with
# other kernels (ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE), 1.5e-4 where a solve stopped unconverged at its cap
# (an iterate, not a fixed point, carries the rounding of every iteration)
RECORD_TOLERANCE = {"nstep": {"abs": 1.0}, "converged": {"abs": 0.34}}
LOSS_TOLERANCE = {"rel": 1e-4, "abs": 1e-4}
UNCONVERGED_LOSS_TOLERANCE = {"rel": 1e-3, "abs": 1e-4}


def recorded_approx(row: dict[str, float]) -> dict:
    """A recorded row of training metrics as the values another CPU's run must match."""
    loss = LOSS_TOLERANCE if row.get("train/deq/converged", 1.0) == 1.0 else UNCONVERGED_LOSS_TOLERANCE
    return {key: pytest.approx(value, **RECORD_TOLERANCE.get(key.rsplit("/", 1)[-1], loss))
            for key, value in row.items()}

FAMILY_CONFIGS = [c for configs, _ in FAMILY_TINY.values() for c in configs]
ids = lambda p: str(p.relative_to(ROOT / "configs"))  # noqa: E731


def test_every_family_and_config_is_covered():
    assert set(family_registry()) == set(FAMILY_TINY), "give every registered family its tiny overrides"
    assert set(CONFIGS) == set(FAMILY_CONFIGS), "every config belongs to a family's list in conftest.py"


@pytest.mark.parametrize("config", FAMILY_CONFIGS, ids=ids)
def test_every_config_parses_and_instantiates(config, tmp_path):
    cli = DeqscoreCLI(args=["--config", str(config), "--runs_root", str(tmp_path)], run=False)
    model = cli.model
    assert isinstance(model, family_registry()[family_of(config)])
    raw = net_options(load_config(config))
    # a DEQ config really builds DEQ layers with the configured options; an explicit one none
    deqs = [m for m in model.modules() if isinstance(m, DEQ)]
    if raw.get("deq"):
        assert deqs and all(getattr(d, k) == v for d in deqs for k, v in (raw["deq"].get("init_args") or {}).items())
    else:
        assert not deqs
    assert cli.trainer.validate_loop.inference_mode is False and cli.trainer.test_loop.inference_mode is False
    assert str(cli.trainer.default_root_dir).startswith(str(tmp_path))
    assert cli.datamodule is not None  # every config is complete on its own
    assert any(isinstance(c, ModelCheckpoint) and c.save_last for c in cli.trainer.callbacks)
    if family_of(config) == "nice":  # densities of images: the exact (invertible) pipeline
        assert cli.datamodule.bits_per_dim_exact
    if family_of(config) == "ncsn":  # score networks on images: k / 255 in [0, 1], averaged weights
        assert cli.datamodule.transform == "pixels" and cli.model.net.image_shape == cli.datamodule.image_shape
        assert any(type(c).__name__ == "EMAWeightAveraging" for c in cli.trainer.callbacks)
    raw_config = load_config(config)
    if raw_config.get("optimizer") is None:  # a family with its own optimisers (the VAE's two) declares them itself
        optimizer = raw_config["model"]["init_args"]["ae_optimizer"]
        opt = model.configure_optimizers()[0]
        assert type(opt).__name__ == optimizer["class_path"].rsplit(".", 1)[-1]
        assert opt.defaults["lr"] == (optimizer.get("init_args") or {}).get("lr", opt.defaults["lr"])
        return
    optimizer = raw_config["optimizer"]
    configured = model.configure_optimizers()
    opt = configured["optimizer"] if isinstance(configured, dict) else configured
    assert type(opt).__name__ == optimizer["class_path"].rsplit(".", 1)[-1]
    lr = (optimizer.get("init_args") or {}).get("lr")  # none: the optimiser's own default
    assert opt.defaults["lr"] == (lr if lr is not None else type(opt)([torch.zeros(1)]).defaults["lr"])
    if config.name == "deq_reference.yaml":  # the reference code's settings (docs/method.md 2.5, 5)
        deq = deqs[0]
        if family_of(config) == "nice":
            assert (len(model.net.m_nets), deq.phantom_steps, deq.injection_prestep, deq.tol) == (2, 1, True, 2e-5)
        else:  # DKEF: K = 2 after the pre-step
            assert (deq.phantom_steps, deq.injection_prestep, deq.tol) == (2, True, 5e-5)


@pytest.mark.parametrize("config", FAMILY_CONFIGS, ids=ids)
def test_print_config_shows_the_whole_resolved_tree(config, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    net = printed["model"]["init_args"]["net"]
    written = load_config(config)["model"]["init_args"]["net"].get("init_args") or {}
    assert net["class_path"] and set(net["init_args"]) > set(written)  # defaults resolved, not only the file's
    assert "dim" not in net["init_args"]  # linked: the network's input dimension is the data module's
    if net["init_args"].get("deq"):
        assert {"solver", "tol", "phantom_steps", "ift_tol"} <= set(net["init_args"]["deq"]["init_args"])
    if "optimizer" in printed and printed["optimizer"]:
        assert "betas" in printed["optimizer"]["init_args"]


@pytest.mark.parametrize("config", FAMILY_CONFIGS, ids=ids)
def test_two_steps_log_the_recorded_losses_and_the_checkpoint_rebuilds_the_module_and_samples_images(config,
                                                                                                   tmp_path):
    cli = main(["fit", *tiny_args(tmp_path, config, "f"), *TWO_STEPS])
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    # the losses (and DEQ iteration counts) of the config as written out in full before it was composed
    name = config.relative_to(ROOT).as_posix()
    assert name in RECORDED_LOSSES, f"{name}: record its first steps with python -m tests.lightning.config_losses"
    expected = RECORDED_LOSSES[name]
    logged = logged_training(tmp_path / "f")
    assert [sorted(row) for row in logged] == [sorted(row) for row in expected]
    # bit-identical on one machine; another CPU sums in another order (MKL picks its kernels by vendor), which may
    # move a residual across the tolerance: a solve one iteration longer, a layer one step short of converging
    assert logged == [recorded_approx(row) for row in expected]
    ckpt = tmp_path / "f" / "checkpoints" / "last.ckpt"
    module = load_module(ckpt)  # the checkpoint alone
    assert isinstance(module, ScoreModule) and type(module) is type(cli.model)
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    assert module.state_dict().keys() == saved.keys()
    assert all(torch.equal(v.cpu(), saved[k]) for k, v in module.state_dict().items())
    assert module.image_codec == cli.datamodule.codec
    if module.image_codec is None:  # not image data: no sample grids, and a clear refusal
        with pytest.raises(ValueError, match="has no image codec"):
            module.sample_images(3)
        return
    torch.manual_seed(0)
    images = module.eval().sample_images(3)
    assert images.shape == (3, *cli.datamodule.image_shape) and images.min() >= 0 and images.max() <= 1
    # sample_images is the data module's transform of sample(). Compared bit for bit, the two must be the same
    # computation: a second module fresh from the checkpoint (a DEQ layer's warm start begins at the fixed point
    # the first draw left, so a second draw of the same module iterates from elsewhere and lands within the
    # solver's tolerance: float32 rounding apart on some CPUs, equal on others), the same seed, and no_grad as
    # sample_images has. The one difference left is the codec: the checkpoint's against the data module's.
    twin = load_module(ckpt).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        direct = cli.datamodule.to_images(twin.sample(3))
    assert torch.equal(images, direct)


@pytest.mark.parametrize("transform", ["unit", "logit", "logit_squeeze"])
def test_sample_images_invert_the_data_transform(transform):
    # a model whose samples are the model-space image of pixel value 0.25 must show 0.25, whatever the transform
    module = ScoreModule()
    codec = ImageCodec(transform, 1e-3, (1, 2, 2))
    pixel = torch.full((5, 4), 0.25, dtype=torch.float64)
    squeezed = 1e-3 + (1 - 2e-3) * pixel
    model_space = {"unit": pixel, "logit": torch.logit(pixel), "logit_squeeze": torch.logit(squeezed)}[transform]
    module.sample = lambda n: model_space[:n]
    module.image_codec = codec
    assert torch.allclose(module.sample_images(5), torch.full((5, 1, 2, 2), 0.25, dtype=torch.float64))
    module.image_codec = None
    with pytest.raises(ValueError, match="has no image codec"):
        module.sample_images(5)


def test_clamp_pipeline_logs_its_bits_per_dim_as_approximate(tmp_path):
    cli = main(["fit", *tiny_args(tmp_path, run_name="clamp"), "--data.init_args.transform", "logit",
                "--trainer.fast_dev_run", "1"])
    metrics = cli.trainer.callback_metrics
    assert "val/bits_per_dim_approx" in metrics and "val/bits_per_dim" not in metrics
    cli = main(["fit", *tiny_args(tmp_path, run_name="squeeze"), "--trainer.fast_dev_run", "1"])
    assert "val/bits_per_dim" in cli.trainer.callback_metrics


def test_resolved_loss_options_are_logged(tmp_path):
    main(["fit", *tiny_args(tmp_path, run_name="dsm"), "--model.init_args.loss", "deqscore.losses.DSM",
          "--model.init_args.loss.weighting", "none", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0"])
    hparams = yaml.safe_load((tmp_path / "dsm" / "hparams.yaml").read_text())
    assert hparams["resolved_loss"] == "DSM(sigma=0.16, weighting='none')"
    saved = yaml.safe_load((tmp_path / "dsm" / "config.yaml").read_text())["model"]["init_args"]["loss"]
    assert saved["init_args"] == {"sigma": 0.16, "weighting": "none"}
