"""Multi-process training on CPU (gloo): run in subprocesses, since the ddp strategy relaunches the command."""

import os
import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch

from .conftest import ROOT, tiny_args

WORKER = ROOT / "tests" / "lightning" / "ddp_worker.py"
TIMEOUT_S = 120  # per process: a multi-process regression (a rank waiting for another) fails fast, not at CI's limit


def _run(args, cwd=ROOT, returncode=0):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
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


def test_fid_under_ddp_is_that_of_the_samples_of_both_processes(tmp_path):
    """Each process draws its share of the FID samples from its own seed; the logged FID must be the distance of
    their union (features summed across processes), recomputed here in one process."""
    from deqscore.lightning import load_module
    from deqscore.lightning.callbacks import read_metrics_csv
    from deqscore.metrics.inception import InceptionFeatures
    from deqscore.metrics.reference import image_stats, load_stats, stats_file
    from deqscore.metrics.statistics import frechet_distance

    n, reference = 6, 10
    args = ["train.py", "fit", *tiny_args(tmp_path, "configs/ncsn/explicit_mnist.yaml", "fid"), "--trainer.max_epochs",
            "1", "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu",
            "--trainer.callbacks+=deqscore.lightning.FIDCallback", "--trainer.callbacks.num_samples", str(n),
            "--trainer.callbacks.reference_images", str(reference), "--trainer.callbacks.stats_root",
            str(tmp_path / "stats"), "--trainer.callbacks.batch_size", "3"]
    _run(args)
    fid = read_metrics_csv(tmp_path / "fid" / "metrics.csv")["val/fid"][-1][1]
    module = load_module(tmp_path / "fid" / "checkpoints" / "last.ckpt").eval()
    images = []
    for rank in (0, 1):  # the callback's seed for (seed 0, epoch 0, rank); three samples each
        torch.manual_seed(7919 * rank)
        images.append(module.sample_images(3))
    key = {"dataset": "mnist", "split": "train", "resolution": "28x28", "count": reference}
    union = image_stats(torch.cat(images), InceptionFeatures())
    assert union.count == n
    assert frechet_distance(union, load_stats(stats_file(key, tmp_path / "stats"), key)) == pytest.approx(fid, rel=1e-4)
    # one process's samples alone give another FID: the gathering is what the test checks
    alone = image_stats(images[0], InceptionFeatures())
    assert frechet_distance(alone, load_stats(stats_file(key, tmp_path / "stats"), key)) != pytest.approx(fid, rel=1e-3)


class SaveRankState(pl.Callback):
    """Every process writes its parameters at the start and the end of training to
    ``<default_root_dir>/rank<r>_{start,end}.pt``."""

    def _save(self, trainer, module, when):
        state = {k: v.detach().clone() for k, v in module.named_parameters()}
        torch.save(state, f"{trainer.default_root_dir}/rank{trainer.global_rank}_{when}.pt")

    def on_train_start(self, trainer, module):
        self._save(trainer, module, "start")

    def on_train_end(self, trainer, module):
        self._save(trainer, module, "end")


def test_vae_under_ddp_keeps_both_optimisers_in_step_across_processes(tmp_path):
    # each process sees other images and draws other noise: only averaged gradients keep their weights equal
    args = ["train.py", "fit", *tiny_args(tmp_path, "configs/vae/deq_mnist.yaml", "vae"), "--trainer.max_steps", "6",
            "--trainer.devices", "2", "--trainer.strategy", "ddp_find_unused_parameters_true",
            "--trainer.accelerator", "cpu", f"--trainer.callbacks+={__name__}.SaveRankState"]
    _run(args)
    state = {(r, when): torch.load(next((tmp_path / "vae").rglob(f"rank{r}_{when}.pt")))
             for r in (0, 1) for when in ("start", "end")}
    assert torch.load(tmp_path / "vae" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    for key in state[0, "end"]:
        assert torch.equal(state[0, "start"][key], state[1, "start"][key]), key
        assert torch.allclose(state[0, "end"][key], state[1, "end"][key], rtol=1e-5, atol=1e-6), key
    moved = {k for k in state[0, "end"] if not torch.equal(state[0, "end"][k], state[0, "start"][k])}
    assert any(k.startswith("net.score.") for k in moved) and any(k.startswith("net.encoder.") for k in moved)
    assert any(k.startswith("net.decoder.") for k in moved)


def test_vae_under_plain_ddp_is_a_usage_error(tmp_path):
    args = ["train.py", "fit", *tiny_args(tmp_path, "configs/vae/explicit_mnist.yaml", "vae"), "--trainer.max_steps",
            "3", "--trainer.devices", "1", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    proc = _run(args, returncode=2)
    assert "ddp_find_unused_parameters_true" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "vae").exists()  # refused before anything is written


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args, tmp_path):
    """Two processes as two nodes of one process each, on this machine (Lightning's manual multi-node launch)."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "NODE_RANK": str(node), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
        procs.append(subprocess.Popen([sys.executable, *args, "--trainer.num_nodes", "2", "--trainer.devices", "1"],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, out[-2000:] + err[-3000:]
    finally:
        for proc in procs:  # a hung rank is killed, not left running
            proc.kill()


def test_two_nodes_train_checkpoint_and_resume_as_two_processes_on_one(tmp_path):
    base = ["train.py", "fit", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    nodes = [*base, *tiny_args(tmp_path, "configs/nice/explicit.yaml", "nodes"), "--trainer.max_steps", "2"]
    single = [*base, *tiny_args(tmp_path, "configs/nice/explicit.yaml", "single"), "--trainer.max_steps", "4",
              "--trainer.devices", "2"]
    _two_nodes(nodes, tmp_path)
    run = tmp_path / "nodes"
    assert (run / "checkpoints" / "last.ckpt").is_file() and not (tmp_path / "nodes.1").exists()
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    _two_nodes(["train.py", "fit", "--config", str(run / "config.yaml"), "--trainer.max_steps", "4",
                "--ckpt_path", str(run / "checkpoints" / "last.ckpt")], tmp_path)
    _run(single)
    resumed = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    straight = torch.load(tmp_path / "single" / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == straight["global_step"] == 4
    for key, value in straight["state_dict"].items():
        assert torch.allclose(resumed["state_dict"][key], value, rtol=1e-5, atol=1e-6), key
