"""Which VAE checkpoint is "best": by a validation AIS log-likelihood for the MLP configs with an implicit encoder
(their ``val/loss`` is a surrogate, not a likelihood), by nothing for the conv configs (only the newest is kept)."""

import pytest
import torch

from deqscore.cli.train import main
from deqscore.configfiles import load_config
from deqscore.lightning.callbacks import read_metrics_csv

from .conftest import ROOT, tiny_args


def _checkpointing(config):
    callbacks = load_config(ROOT / config)["trainer"]["callbacks"]
    return next(c["init_args"] for c in callbacks if c["class_path"].endswith("ModelCheckpoint"))


@pytest.mark.parametrize("config", ["configs/vae/deq_mnist.yaml", "configs/vae/explicit_mnist.yaml"])
def test_mlp_configs_keep_the_checkpoint_of_the_best_validation_ais(tmp_path, config):
    assert _checkpointing(config)["monitor"] == "val/ais_log_likelihood" and _checkpointing(config)["mode"] == "max"
    cli = main(["fit", *tiny_args(tmp_path, config), "--trainer.max_epochs", "3", "--trainer.max_steps", "-1"])
    series = read_metrics_csv(tmp_path / "t" / "metrics.csv")["val/ais_log_likelihood"]
    assert len(series) == 3
    values = [v for _, v in series]
    best = torch.load(cli.trainer.checkpoint_callback.best_model_path, weights_only=False)
    assert best["epoch"] == values.index(max(values))
    assert float(cli.trainer.checkpoint_callback.best_model_score) == pytest.approx(max(values), rel=1e-6)


@pytest.mark.parametrize("config", ["configs/vae/deq_celeba.yaml", "configs/vae/deq_cifar10.yaml",
                                    "configs/vae/explicit_celeba.yaml"])
def test_conv_configs_choose_no_best_checkpoint(config):
    assert _checkpointing(config).get("monitor") is None and _checkpointing(config)["save_last"]
