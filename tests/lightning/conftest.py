"""Tiny, fast settings for running the real CLI on the embedded MNIST, per model family (in one place).

A new family adds its configs' directory and its tiny overrides to ``FAMILY_TINY``; the parametrised tests of
``test_families.py`` then run every one of its configs (parse, ``fast_dev_run``, checkpoint and resume,
sampling) without further code.
"""

import functools
import tempfile
import warnings
from pathlib import Path

import pytest
import yaml

from tests.data.fake_images import write_celeba, write_cifar10

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))

_TINY_BATCHES = ["--data.init_args.batch_size", "16", "--data.init_args.eval_batch_size", "16"]
_TINY_TRAINER = [
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--trainer.log_every_n_steps", "1",
]


def _nice_tiny(config: dict) -> list[str]:
    net = "--model.init_args.net.init_args"
    args = [f"{net}.hidden", "12", f"{net}.n_layers", "3", f"{net}.n_couplings", "2",
            "--model.init_args.exact_sm_samples", "4", "--data.init_args.train_subset", "48",
            "--data.init_args.val_subset", "16", "--data.init_args.test_subset", "16"]
    if config["model"]["init_args"]["net"]["init_args"].get("deq"):
        args += [f"{net}.deq.init_args.max_iter", "40", f"{net}.deq.init_args.tol", "1e-5"]
    return args


UCI_DATA = ROOT / "datasets" / "uci"  # the UCI files shipped with the project


def _dkef_tiny(config: dict) -> list[str]:
    net = "--model.init_args.net.init_args"
    args = [f"{net}.n_centres", "8", f"{net}.hidden", "6", "--model.init_args.alpha_points", "40",
            "--model.init_args.log_z_samples", "2000", "--model.init_args.final_log_z_samples", "2000",
            "--model.init_args.log_z_chunk", "500", "--model.init_args.final_lambda_steps", "2",
            "--model.init_args.exact_sm_batches", "1", "--data.init_args.root", str(UCI_DATA),
            "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2"]
    if config["model"]["init_args"]["net"]["init_args"].get("deep_layers"):
        args += [f"{net}.deep_layers", "4"]
    return args


@functools.cache
def fake_image_data() -> Path:
    """A data folder with a few random CIFAR-10 and CelebA images in their on-disk formats, decoded once (per
    process); the CIFAR-10 files differ from the originals, whose checksum warning is silenced here."""
    root = Path(tempfile.mkdtemp(prefix="deqscore-fake-images-"))
    write_cifar10(root, per_batch=6, n_test=8)
    write_celeba(root, partitions=(0,) * 24 + (2,) * 4)
    warnings.filterwarnings("ignore", "MD5 differs from the CIFAR-10 original")
    return root


def _ncsn_tiny(config: dict) -> list[str]:
    net = "--model.init_args.net.init_args"
    sampler = "--model.init_args.sampler.init_args"
    args = [f"{net}.ngf", "4", "--model.init_args.n_levels", "3", f"{sampler}.n_steps_each", "1",
            "--data.init_args.num_workers", "0", "--trainer.limit_train_batches", "3",
            "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "null",
            "--trainer.check_val_every_n_epoch", "1", "--trainer.max_steps", "-1"]
    if config["model"]["init_args"]["net"]["init_args"].get("deq"):
        args += [f"{net}.deq.init_args.max_iter", "30", f"{net}.deq.init_args.tol", "1e-4"]
    data = config["data"]["class_path"].rsplit(".", 1)[-1]
    if data != "MNISTDataModule":  # CIFAR-10 / CelebA: a few fake images in their on-disk formats
        args += ["--data.init_args.data_dir", str(fake_image_data()), "--data.init_args.use_lmdb", "false"]
    else:
        args += ["--data.init_args.train_subset", "48", "--data.init_args.val_subset", "16",
                 "--data.init_args.test_subset", "16"]
    return args


def _vae_tiny(config: dict) -> list[str]:
    net = "--model.init_args.net.init_args"
    init = config["model"]["init_args"]["net"]["init_args"]
    args = [f"{net}.z_dim", "3", f"{net}.hidden", "16", "--trainer.limit_train_batches", "3",
            "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "1"]
    if "eps_dim" in init:
        args += [f"{net}.eps_dim", "3"]
    if init.get("arch") == "conv":
        args += [f"{net}.nef", "4", "--data.init_args.data_dir", str(fake_image_data()),
                 "--data.init_args.num_workers", "0", "--data.init_args.use_lmdb", "false"]
    else:
        args += ["--data.init_args.train_subset", "48", "--data.init_args.val_subset", "16",
                 "--data.init_args.test_subset", "16", "--model.init_args.ais_batches", "1",
                 "--model.init_args.ais_steps", "5", "--model.init_args.ais_chains", "2",
                 "--model.init_args.val_ais_steps", "3"]
    if init.get("deq"):
        args += [f"{net}.deq.init_args.max_iter", "30", f"{net}.deq.init_args.tol", "1e-4"]
    return args


#: family -> (its configs, a function giving the overrides that shrink one of them to seconds on a CPU)
FAMILY_TINY = {
    "nice": ([*sorted((ROOT / "configs" / "nice").glob("*.yaml")), ROOT / "configs" / "demo.yaml"], _nice_tiny),
    "dkef": (sorted((ROOT / "configs" / "dkef").glob("*.yaml")), _dkef_tiny),
    "ncsn": (sorted((ROOT / "configs" / "ncsn").glob("*.yaml")), _ncsn_tiny),
    "vae": (sorted((ROOT / "configs" / "vae").glob("*.yaml")), _vae_tiny),
}


def family_of(config: Path) -> str:
    """The family whose configs include ``config``."""
    return next(f for f, (configs, _) in FAMILY_TINY.items() if Path(config) in configs)


def tiny_args(tmp_path: Path, config: str | Path = "configs/nice/deq.yaml", run_name: str = "t") -> list[str]:
    """Command-line arguments that shrink any config to seconds on a CPU."""
    path = ROOT / config
    shrink = FAMILY_TINY[family_of(path)][1]
    return ["--config", str(path), "--run_name", run_name, "--runs_root", str(tmp_path),
            *shrink(yaml.safe_load(path.read_text())), *_TINY_BATCHES, *_TINY_TRAINER]


@pytest.fixture
def root() -> Path:
    return ROOT
