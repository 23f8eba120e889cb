"""Tiny, fast settings for running the real CLI on the embedded MNIST, per model family (in one place).

A new family's declaration (``deqscore/families/<name>.py``) gives its configs and its fixtures
(``tests/families/<name>.py``) its tiny overrides; the parametrised tests of ``test_families.py`` then run every
one of its configs (parse, ``fast_dev_run``, checkpoint and resume, sampling) without further code.
"""

import atexit
import functools
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

from deqscore.configfiles import is_base, load_config
from deqscore.families import declarations
from tests.data.fake_images import write_celeba, write_cifar10
from tests.families import fixture_file

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if not is_base(p))  # runnable configs

_TINY_BATCHES = ["--data.init_args.batch_size", "16", "--data.init_args.eval_batch_size", "16"]
_TINY_TRAINER = [
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--trainer.log_every_n_steps", "1",
]


@functools.cache
def fake_image_data() -> Path:
    """A data folder with a few random CIFAR-10 and CelebA images in their on-disk formats, decoded once (per
    process); the CIFAR-10 files differ from the originals, whose checksum warning is silenced here."""
    root = Path(tempfile.mkdtemp(prefix="deqscore-fake-images-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # a test session leaves nothing in the temp folder
    write_cifar10(root, per_batch=6, n_test=8)
    write_celeba(root, partitions=(0,) * 24 + (2,) * 4)
    warnings.filterwarnings("ignore", "MD5 differs from the CIFAR-10 original")
    return root


def family_tiny() -> dict:
    """Family -> (its configs, a function giving the overrides that shrink one of them to seconds on a CPU), for
    every declared family (:mod:`deqscore.families`), its overrides from its fixtures (``tests/families``)."""
    return {name: (d.all_configs(), functools.partial(fixture_file(name).tiny, images=fake_image_data))
            for name, d in declarations().items()}


FAMILY_TINY = family_tiny()


def family_of(config: Path) -> str:
    """The family whose configs include ``config``."""
    return next(f for f, (configs, _) in FAMILY_TINY.items() if Path(config) in configs)


def tiny_args(tmp_path: Path, config: str | Path = "configs/nice/deq.yaml", run_name: str = "t") -> list[str]:
    """Command-line arguments that shrink any config to seconds on a CPU."""
    path = ROOT / config
    shrink = FAMILY_TINY[family_of(path)][1]
    return ["--config", str(path), "--run_name", run_name, "--runs_root", str(tmp_path),
            *shrink(load_config(path)), *_TINY_BATCHES, *_TINY_TRAINER]


@pytest.fixture
def root() -> Path:
    return ROOT
