"""Multi-process training on CPU (gloo): run in subprocesses, since the ddp strategy relaunches the command."""

import os
import subprocess
import sys

import torch

from .conftest import ROOT, tiny_args

WORKER = ROOT / "tests" / "lightning" / "ddp_worker.py"


def _run(args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_two_processes_give_the_single_process_update(tmp_path):
    _run([str(WORKER), str(tmp_path / "one.pt"), "1"])
    _run([str(WORKER), str(tmp_path / "two.pt"), "2"])
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert all(torch.equal(one["init"][k], two["init"][k]) for k in one["init"])  # same start
    for key in one["final"]:
        assert torch.allclose(one["final"][key], two["final"][key], rtol=1e-5, atol=1e-7), key
    # not vacuous: SGD moved the score parameters, and the bias without a score stayed exactly where it was
    moved = [k for k in one["final"] if not torch.allclose(one["final"][k], one["init"][k], atol=1e-6)]
    assert len(moved) >= len(one["final"]) - 1
    assert torch.equal(two["final"]["energy_bias"], two["init"]["energy_bias"])


def test_cli_ddp_run_writes_checkpoint(tmp_path):
    args = ["train.py", "fit", *tiny_args(tmp_path, "configs/nice/deq.yaml", "ddp"), "--trainer.max_steps", "2",
            "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    _run(args)
    run = tmp_path / "ddp"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2
