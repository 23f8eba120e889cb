"""A noise schedule from the training data (NCSNv2's recipe): sigma_max is the largest pairwise distance (against a
brute-force loop), the level count follows from the ratio, the Langevin step from the steps per level, and the
values travel with the checkpoint to a resume and to sample.py."""

import itertools
import math

import numpy as np
import pytest
import torch

from deqscore.cli.train import main
from deqscore.errors import ConfigError
from deqscore.lightning import load_module
from deqscore.losses import noise_schedule
from deqscore.losses.annealed import geometric_ratio, langevin_step_size, schedule_from_data

from .conftest import tiny_args


def test_schedule_from_data_against_a_hand_computation():
    x = torch.rand(30, 12, generator=torch.Generator().manual_seed(0))
    rows = x.numpy().astype(np.float64)
    brute = max(math.sqrt(((a - b) ** 2).sum()) for a, b in itertools.combinations(rows, 2))
    derived = schedule_from_data(x, 0.01, 3)
    assert derived["sigma_max"] == pytest.approx(brute, rel=1e-12)
    gamma = derived["gamma"]
    phi = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
    root = math.sqrt(2 * 12)
    assert phi(root * (gamma - 1) + 3 * gamma) - phi(root * (gamma - 1) - 3 * gamma) == pytest.approx(0.5, abs=1e-8)
    assert derived["n_levels"] == math.ceil(math.log(brute / 0.01) / math.log(gamma)) + 1
    # NCSNv2's published step sizes for its CIFAR-10 (sigma 50, L 232) and CelebA (sigma 90, L 500) schedules, T = 5
    assert langevin_step_size(0.01, (50 / 0.01) ** (1 / 231), 5) == pytest.approx(6.2e-6, rel=0.01)
    assert langevin_step_size(0.01, (90 / 0.01) ** (1 / 499), 5) == pytest.approx(3.3e-6, rel=0.02)
    with pytest.raises(ConfigError, match="dimension >= 5"):
        geometric_ratio(4)


def test_a_run_takes_its_schedule_from_the_data_and_keeps_it(tmp_path):
    args = [*tiny_args(tmp_path, "configs/ncsn/explicit_mnist.yaml", "sched"), "--trainer.max_epochs", "1",
            "--model.init_args.schedule_from_data", "true", "--model.init_args.schedule_data_subset", "40"]
    cli = main(["fit", *args])
    train = cli.datamodule.train_dataset
    x = torch.stack([train[i][0] for i in range(40)])
    derived = schedule_from_data(x, 0.01, cli.model.sampler.n_steps_each)
    expected = noise_schedule("geometric", derived["sigma_max"], 0.01, derived["n_levels"]).float()
    assert torch.equal(cli.model.sigmas, expected) and cli.model.sampler.step_lr == derived["step_lr"]
    assert derived["sigma_max"] > 5  # MNIST in [0, 1]: far above the config's fixed sigma_max of 1
    restored = load_module(tmp_path / "sched" / "checkpoints" / "last.ckpt")
    assert torch.equal(restored.sigmas, expected) and restored.sampler.step_lr == derived["step_lr"]
