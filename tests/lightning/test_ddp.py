"""Multi-process training on CPU (gloo): run in subprocesses, since the ddp strategy relaunches the command."""

import os
import signal
import subprocess
import sys
import time

import pytest
import pytorch_lightning as pl
import torch

from deqscore.privates import PatientObserver

from .conftest import ROOT, tiny_args

pytestmark = pytest.mark.xdist_group("processes")  # see the Makefile's test target

WORKER = ROOT / "tests" / "lightning" / "ddp_worker.py"
EXIT_PROBE = ROOT / "tests" / "lightning" / "exit_probe.py"
TIMEOUT_S = 120  # per process: a multi-process regression (a rank waiting for another) fails fast, not at CI's limit


def _run(args, cwd=ROOT, returncode=0, **env_vars):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env_vars}
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


def test_cli_ddp_run_writes_checkpoint_and_every_rank_leaves_its_process_group(tmp_path):
    """A finished run destroys its process group on every rank before exiting: left to the interpreter's exit,
    gloo's teardown can abort a rank (SIGABRT), and the launcher then kills the run."""
    args = [str(EXIT_PROBE), "fit", *tiny_args(tmp_path, "configs/nice/deq.yaml", "ddp"), "--trainer.max_steps", "2",
            "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    _run(args, EXIT_PROBE=str(tmp_path))
    assert [(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)] == ["left", "left"]
    run = tmp_path / "ddp"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2


# the features' all-reduce across two processes is tests/metrics/test_fid.py's; this runs it through a whole DDP
# fit (50 s)
@pytest.mark.slow
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
    features, real = InceptionFeatures(), load_stats(stats_file(key, tmp_path / "stats"), key)
    union = image_stats(torch.cat(images), features)
    assert union.count == n
    assert frechet_distance(union, real) == pytest.approx(fid, rel=1e-4)
    # one process's samples alone give another FID: the gathering is what the test checks
    assert frechet_distance(image_stats(images[0], features), real) != pytest.approx(fid, rel=1e-3)


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


# a node rank beside the process rank; the one-node DDP fit, checkpoint and resume are the fast suite's (35 s)
@pytest.mark.slow
def test_two_nodes_train_checkpoint_and_resume_as_two_processes_on_one(tmp_path):
    """Two nodes stop at step 2, in the middle of an epoch (4 batches a rank), and resume to step 4: as one node
    of two processes trained straight to it (the resumed epoch skips its first batches in each rank's shard)."""
    base = ["train.py", "fit", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    epoch = ["--data.init_args.train_subset", "128"]
    nodes = [*base, *tiny_args(tmp_path, "configs/nice/explicit.yaml", "nodes"), *epoch, "--trainer.max_steps", "2"]
    single = [*base, *tiny_args(tmp_path, "configs/nice/explicit.yaml", "single"), *epoch, "--trainer.max_steps", "4",
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


def test_a_non_finite_loss_on_one_rank_stops_every_rank_before_the_update(tmp_path):
    """Rank 1's loss is NaN at step 1 (tests/lightning/faults.py): both processes stop in that step, none hangs
    in the gradient all-reduce, rank 0 prints one line naming rank 1, and the last checkpoint is step 1's."""
    args = ["train.py", "fit", *tiny_args(tmp_path, "configs/nice/explicit.yaml", "nan"), "--model.class_path",
            "tests.lightning.faults.NonFiniteOnRankOne", "--trainer.max_steps", "4", "--trainer.devices", "2",
            "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    proc = _run(args, returncode=1)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "rank 1: train loss" in errors[0] and "global step 1" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = torch.load(tmp_path / "nan" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 1
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())


DDP_CPU = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]


def test_a_non_finite_validation_loss_on_one_rank_stops_every_rank_at_the_epochs_end(tmp_path):
    """Rank 1's validation loss is NaN (tests/lightning/faults.py): the ranks read the check together at the end of
    the validation epoch, so both stop there, none waits for the other until the process group's timeout (set
    longer than this test waits), and rank 0 prints one line naming rank 1; no checkpoint of that validation."""
    args = ["train.py", "fit", *tiny_args(tmp_path, "configs/nice/explicit.yaml", "valnan"), "--model.class_path",
            "tests.lightning.faults.NonFiniteValidationOnRankOne", "--trainer.max_steps", "6", *DDP_CPU,
            "--process_group_timeout", str(10 * TIMEOUT_S)]
    proc = _run(args, returncode=1)
    errors = _errors(proc.stderr)
    assert len(errors) == 1 and "rank 1: val loss" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "valnan" / "checkpoints").glob("*.ckpt"))  # the epoch's NaN validation saved nothing


def _start(args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _kill_after_first_checkpoint(proc, run, victim):
    """SIGKILL one rank of a running 2-process fit once it has written a checkpoint: ``victim(proc)`` is its pid;
    the run's stderr and the seconds from the kill to the end of every process."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (run / "checkpoints" / "last.ckpt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    killed = time.monotonic()
    os.kill(victim(proc), signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)  # also waits for the surviving rank: its pipes are these
    finally:
        proc.kill()
    return err, time.monotonic() - killed


def _child_pid(proc):
    deadline = time.monotonic() + TIMEOUT_S
    while not (pids := subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return int(pids[0])


def _errors(stderr):
    return [line for line in stderr.splitlines() if line.startswith("train.py: error:")]


def test_a_killed_rank_is_named_and_the_run_resumes_exactly(tmp_path):
    """kill -9 of rank 1 mid-training: rank 0 stops within seconds with one line naming rank 1; the run resumes
    from its last checkpoint to the weights of an uninterrupted run, bit for bit (a warm-starting DEQ: each rank's
    warm starts travel in the checkpoint)."""
    fit = ["train.py", "fit", *tiny_args(tmp_path, "configs/nice/deq.yaml", "killed"), *DDP_CPU]
    proc = _start([*fit, "--trainer.max_steps", "100000"])
    run = tmp_path / "killed"
    err, seconds = _kill_after_first_checkpoint(proc, run, _child_pid)
    assert proc.returncode == 1 and seconds < 30, err[-3000:]
    lines = _errors(err)
    assert len(lines) == 1 and "rank 1 (pid" in lines[0] and "SIGKILL" in lines[0], err[-3000:]
    assert "Traceback" not in err
    step = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    target = ["--trainer.max_steps", str(step + 4)]
    _run(["train.py", "fit", "--config", str(run / "config.yaml"), "--ckpt_path",
          str(run / "checkpoints" / "last.ckpt"), *target])
    _run(["train.py", "fit", *tiny_args(tmp_path, "configs/nice/deq.yaml", "straight"), *DDP_CPU, *target])
    resumed = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == straight["global_step"] == step + 4
    for key, value in straight["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key


def test_the_launchers_watch_gives_the_first_process_time_to_report():
    """A launched rank that exits with an error: the watch kills the first process (here a stand-in) only once the
    grace period has passed, which leaves the first process the time to name the lost rank; Lightning's own watch
    kills it at its first look."""
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    failed.wait()
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        observer = PatientObserver(main_pid=first.pid, child_processes=[failed])
        observer.grace_s = 1.0
        assert observer._run() is False
        time.sleep(0.5)
        assert observer._run() is False and first.poll() is None
        time.sleep(0.6)
        assert observer._run() is True
        assert first.wait(timeout=10) == -signal.SIGKILL
    finally:
        first.kill()


@pytest.mark.slow  # the watch's grace period itself is checked above, in one process, in a second
def test_a_rank_that_dies_while_the_first_is_slow_is_still_named(tmp_path):
    """Rank 1 exits while rank 0 is busy for longer than the launcher's watch takes to see it (faults.py): rank 0
    still names rank 1 in one line; the watch does not kill it first."""
    args = ["train.py", "fit", *tiny_args(tmp_path, "configs/nice/explicit.yaml", "slow"), *DDP_CPU,
            "--model.class_path", "tests.lightning.faults.RankOneDiesWhileRankZeroIsSlow", "--trainer.max_steps", "4"]
    proc = _run(args, returncode=1)
    lines = _errors(proc.stderr)
    assert len(lines) == 1 and "rank 1 (pid" in lines[0] and "exited with status 7" in lines[0], proc.stderr[-3000:]


def test_a_killed_rank_zero_is_named_by_the_rank_it_launched(tmp_path):
    fit = ["train.py", "fit", *tiny_args(tmp_path, "configs/nice/explicit.yaml", "killed0"), *DDP_CPU,
           "--trainer.max_steps", "100000"]
    proc = _start(fit)
    err, seconds = _kill_after_first_checkpoint(proc, tmp_path / "killed0", lambda p: p.pid)
    assert seconds < 30
    lines = _errors(err)
    assert len(lines) == 1 and "rank 0 (this process's launcher) was lost" in lines[0], err[-3000:]


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_stopped_after_the_process_group_timeout(tmp_path):
    """Rank 1 sleeps in step 1 (tests/lightning/faults.py): rank 0 waits --process_group_timeout, then stops it
    and names it; nothing of the run is left running."""
    args = ["train.py", "fit", *tiny_args(tmp_path, "configs/nice/explicit.yaml", "stuck"), *DDP_CPU,
            "--model.class_path", "tests.lightning.faults.StuckOnRankOne", "--trainer.max_steps", "4",
            "--process_group_timeout", "15"]
    started = time.monotonic()
    proc = _run(args, returncode=1)
    assert time.monotonic() - started < 15 + 40  # not the stuck rank's 60 s
    lines = _errors(proc.stderr)
    assert len(lines) == 1 and "rank 1 (pid" in lines[0] and "process-group timeout (15 s)" in lines[0], \
        proc.stderr[-3000:]


def test_a_preempted_ddp_run_says_so_once(tmp_path):
    """SIGTERM to the launcher (rank 0) alone: both ranks stop at the same batch with the state saved, and the run
    prints one error line, not one per rank."""
    fit = ["train.py", "fit", *tiny_args(tmp_path, "configs/nice/explicit.yaml", "term"), *DDP_CPU,
           "--trainer.max_steps", "100000", "--trainer.callbacks+=tests.lightning.test_preemption.StepMarker"]
    proc = _start(fit)
    step = tmp_path / "term" / "step"
    deadline = time.monotonic() + TIMEOUT_S
    while not (step.exists() and step.read_text() and int(step.read_text()) >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    lines = _errors(err)
    assert len(lines) == 1 and "preempted by SIGTERM" in lines[0], err[-3000:]
    assert (tmp_path / "term" / "checkpoints" / "interrupted.ckpt").is_file()


GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer [127.0.0.1]:58474. "
              "This is typically caused by a remote worker crashing. Check the logs of the remote worker before "
              "reporting an error.\nException raised from ...")


def test_the_lost_rank_message_keeps_the_transports_sentences_whole():
    from types import SimpleNamespace

    from deqscore.cli.ranks import lost_rank_message

    strategy = SimpleNamespace(launcher=None, global_rank=0)  # a rank of another node was lost
    message = lost_rank_message(RuntimeError(GLOO_RESET), strategy, False, 1800.0, "run/checkpoints/last.ckpt")
    assert "(Connection closed by peer [127.0.0.1]:58474. This is typically caused by a remote worker crashing. " \
           "Check the logs of the remote worker before reporting an error)" in message, message
    assert "pair.cc" not in message and "resume with --ckpt_path run/checkpoints/last.ckpt" in message
    # a run that had saved no checkpoint is not sent to one
    message = lost_rank_message(RuntimeError(GLOO_RESET), strategy, False, 1800.0, None)
    assert ".ckpt" not in message and "saved no checkpoint yet" in message


def test_a_parent_is_lost_only_once_this_process_has_another():
    """A worker reads its launcher's death from its own parent pid, which changes a moment after the launcher's
    sockets close: it waits for the change, and a live parent is never called lost. Here a real launcher process
    is killed while its worker waits."""
    from deqscore.cli.ranks import parent_lost

    started = time.monotonic()
    assert not parent_lost(os.getppid(), wait_s=0.2) and time.monotonic() - started >= 0.2
    worker = ("import os, sys; from deqscore.cli.ranks import parent_lost; launcher = os.getppid(); "
              "print(launcher, flush=True); sys.stdin.readline(); print(parent_lost(launcher, wait_s=5.0), flush=True)")
    launcher = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert int(proc.stdout.readline()) == proc.pid  # the worker's parent is the launcher
        proc.kill()
        proc.wait()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "True"
    finally:
        proc.kill()
