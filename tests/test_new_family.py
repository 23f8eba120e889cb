"""The fifth-family walk of docs/contributing.md ("Adding a model family"), done literally in a copy of the
repository: a toy family (a 2-D energy network, explicit or DEQ, trained with DSM on a synthetic Gaussian) is its
model file, its module file, two configs, its declaration and its test fixtures: 6 new files and 0 edits. The one
command of step 5 records its configs' first training steps (the only file it changes is the record), and then
the tests every family gets pass for it unchanged: the declarations, the phantom probe, the configs' parse, two
recorded steps, the checkpoint's rebuild, and the exact resume."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("deqscore", "lab", "tests", "configs", "pyproject.toml")

MODEL = '''"""A 2-D energy network: E(x) = w . z, z = tanh(B tanh(A x)) or the fixed point z = tanh(0.5 W z + A x)."""

import torch
from torch import nn

from deqscore.deq import DEQFactory


class EnergyMap(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, z, u):
        return torch.tanh(0.5 * self.lin(z) + u)


class Energy2D(nn.Module):
    def __init__(self, dim: int = 2, hidden: int = 16, deq: DEQFactory | None = None):
        super().__init__()
        self.inject = nn.Linear(dim, hidden)
        self.layer = deq(EnergyMap(hidden)) if deq is not None else nn.Linear(hidden, hidden)
        self.is_deq = deq is not None
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        u = self.inject(x)
        z = self.layer(u) if self.is_deq else torch.tanh(self.layer(torch.tanh(u)))
        return self.out(z).squeeze(-1)
'''

MODULE = '''"""The 2-D energy network trained by denoising score matching."""

import torch

from deqscore.deq import require_backward
from deqscore.losses import DSM, score_from_energy
from deqscore.models.energy2d import Energy2D

from .base import ScoreModule


class Energy2DModule(ScoreModule):
    def __init__(self, net: Energy2D, sigma: float = 0.1):
        super().__init__()
        self.net = net
        self.loss = DSM(sigma)
        require_backward(self.net, 2, user="DSM of an energy")

    def compute_loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss(score_from_energy(self.net), x)
'''

EXPLICIT = """base: ../_base.yaml
run_name: energy2d_explicit
trainer:
  max_epochs: 10
model:
  class_path: deqscore.lightning.energy2d.Energy2DModule
  init_args:
    net:
      class_path: deqscore.models.energy2d.Energy2D
data:
  class_path: deqscore.data.UCIDataModule
  init_args:
    dataset: highdim
    dim: 2
"""

DEQ = EXPLICIT.replace("energy2d_explicit", "energy2d_deq").replace(
    "      class_path: deqscore.models.energy2d.Energy2D\n",
    "      class_path: deqscore.models.energy2d.Energy2D\n      init_args:\n        deq:\n"
    "          class_path: deqscore.deq.DEQ\n          init_args:\n            tol: 1.0e-06\n")

DECLARATION = '''"""A toy 2-D energy network, explicit or DEQ."""

from . import Declaration

DECLARATION = Declaration(
    name="energy2d",
    module="deqscore.lightning.energy2d.Energy2DModule",
    configs={"shallow": "explicit.yaml", "deq": "deq.yaml"},
)
'''

FIXTURES = '''"""The toy 2-D energy family's test fixtures."""


def tiny(config: dict, images) -> list[str]:
    return ["--model.init_args.net.init_args.hidden", "8", "--data.init_args.batch_size", "32",
            "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2"]


def phantom_probe(deq):
    import torch

    from deqscore.lightning.energy2d import Energy2DModule
    from deqscore.models.energy2d import Energy2D

    module = Energy2DModule(Energy2D(hidden=5, deq=deq)).double()
    x = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return module, lambda: module.compute_loss(x)
'''

NEW_FILES = {
    "deqscore/models/energy2d.py": MODEL,
    "deqscore/lightning/energy2d.py": MODULE,
    "configs/energy2d/explicit.yaml": EXPLICIT,
    "configs/energy2d/deq.yaml": DEQ,
    "deqscore/families/energy2d.py": DECLARATION,
    "tests/families/energy2d.py": FIXTURES,
}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def _run(copy: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{copy / 'lab'}", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=900)


def test_a_fifth_family_takes_six_new_files_and_no_edit(tmp_path):
    copy = tmp_path / "repo"
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, copy / name)
    (copy / "datasets").symlink_to(ROOT / "datasets")
    before = _files(copy)
    for path, text in NEW_FILES.items():
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        (copy / path).write_text(text)
    recorded = _run(copy, "-m", "tests.lightning.config_losses")  # step 5's one command
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    after = _files(copy)
    new = sorted(set(after) - set(before))
    edited = sorted(p for p in set(before) & set(after) if before[p] != after[p])
    assert new == sorted(NEW_FILES) and len(new) <= 6
    assert edited == ["tests/lightning/config_losses.json"]  # written by the command, not by hand
    tests = _run(copy, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-W", "ignore",
                 "tests/test_declarations.py", "tests/deq/test_family_phantom.py",
                 "tests/lightning/test_families.py", "tests/lightning/test_cli.py",
                 "-k", "test_declarations or energy2d")
    assert tests.returncode == 0, tests.stdout[-4000:]
    passed = {line.split(" ")[0].split("::")[-1] for line in tests.stdout.splitlines() if " PASSED" in line}
    for config in ("energy2d/explicit.yaml", "energy2d/deq.yaml"):
        for test in ("test_every_config_parses_and_instantiates", "test_resume_continues_exactly",
                     "test_two_steps_log_the_recorded_losses_and_the_checkpoint_rebuilds_the_module_and_samples_images"):
            assert f"{test}[{config}]" in passed, (test, config)
    assert "test_phantom_loss_gradient_equals_the_hand_written_steps[energy2d]" in passed
    assert "test_hiding_a_declaration_removes_the_family_everywhere" in passed
