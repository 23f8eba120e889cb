"""Tiny, fast settings for running the real CLI on the embedded MNIST."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def tiny_args(tmp_path: Path, config: str = "configs/nice/deq.yaml", run_name: str = "t") -> list[str]:
    """Command-line arguments that shrink any NICE config to seconds on a CPU."""
    return [
        "--config", str(ROOT / config),
        "--run_name", run_name,
        "--runs_root", str(tmp_path),
        "--model.init_args.hidden", "12",
        "--model.init_args.n_layers", "3",
        "--model.init_args.n_couplings", "2",
        "--model.init_args.max_iter", "40",
        "--model.init_args.tol", "1e-5",
        "--model.init_args.exact_sm_samples", "4",
        "--data.init_args.batch_size", "16",
        "--data.init_args.eval_batch_size", "16",
        "--data.init_args.train_subset", "48",
        "--data.init_args.val_subset", "16",
        "--data.init_args.test_subset", "16",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.log_every_n_steps", "1",
    ]


@pytest.fixture
def root() -> Path:
    return ROOT
