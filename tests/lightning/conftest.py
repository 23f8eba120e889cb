"""Tiny, fast settings for running the real CLI on the embedded MNIST, per model family (in one place).

A new family adds its configs' directory and its tiny overrides to ``FAMILY_TINY``; the parametrised tests of
``test_families.py`` then run every one of its configs (parse, ``fast_dev_run``, checkpoint and resume,
sampling) without further code.
"""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))

_TINY_DATA = [
    "--data.init_args.batch_size", "16",
    "--data.init_args.eval_batch_size", "16",
    "--data.init_args.train_subset", "48",
    "--data.init_args.val_subset", "16",
    "--data.init_args.test_subset", "16",
]
_TINY_TRAINER = [
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--trainer.log_every_n_steps", "1",
]


def _nice_tiny(config: dict) -> list[str]:
    net = "--model.init_args.net.init_args"
    args = [f"{net}.hidden", "12", f"{net}.n_layers", "3", f"{net}.n_couplings", "2",
            "--model.init_args.exact_sm_samples", "4"]
    if config["model"]["init_args"]["net"]["init_args"].get("deq"):
        args += [f"{net}.deq.init_args.max_iter", "40", f"{net}.deq.init_args.tol", "1e-5"]
    return args


#: family -> (its configs, a function giving the overrides that shrink one of them to seconds on a CPU)
FAMILY_TINY = {
    "nice": ([*sorted((ROOT / "configs" / "nice").glob("*.yaml")), ROOT / "configs" / "demo.yaml"], _nice_tiny),
}


def family_of(config: Path) -> str:
    """The family whose configs include ``config``."""
    return next(f for f, (configs, _) in FAMILY_TINY.items() if Path(config) in configs)


def tiny_args(tmp_path: Path, config: str | Path = "configs/nice/deq.yaml", run_name: str = "t") -> list[str]:
    """Command-line arguments that shrink any config to seconds on a CPU."""
    path = ROOT / config
    shrink = FAMILY_TINY[family_of(path)][1]
    return ["--config", str(path), "--run_name", run_name, "--runs_root", str(tmp_path),
            *shrink(yaml.safe_load(path.read_text())), *_TINY_DATA, *_TINY_TRAINER]


@pytest.fixture
def root() -> Path:
    return ROOT
