"""Runs you can trust: what the user typed wins over the checkpoint, run directories are not overwritten by
accident, checkpoint files are complete or absent, resumed logs are true, Ctrl-C leaves a resumable state."""

import errno
import hashlib
import os
import shutil
import signal

import pytest
import pytorch_lightning as pl
import torch
import yaml

from deqscore import files
from deqscore.cli.train import main, run
from deqscore.configfiles import load_config
from deqscore.lightning.callbacks import read_metrics_csv
from deqscore.lightning.runs import AtomicCheckpointIO, RunLock

from .conftest import ROOT, tiny_args

EXPLICIT = "configs/nice/explicit.yaml"


def _fit(tmp_path, name, epochs=1, extra=(), config=EXPLICIT):
    return main(["fit", *tiny_args(tmp_path, config, name), "--trainer.max_epochs", str(epochs), *extra])


def _tree(path):
    """{relative file: sha256} of everything under ``path``."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------- precedence


def test_evaluation_options_given_with_a_checkpoint_take_effect(tmp_path):
    _fit(tmp_path, "r")
    run_dir = tmp_path / "r"
    args = ["test", "--config", str(run_dir / "config.yaml"), "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt"),
            "--data.init_args.eval_batch_size", "8"]
    one = main(args)
    every = main([*args, "--model.init_args.exact_sm_batches", "-1"])
    assert one.model.exact_sm_batches == 1 and every.model.exact_sm_batches == -1
    # the metric is the mean over both test batches, not the first one alone
    assert every.trainer.callback_metrics["test/exact_sm"] != one.trainer.callback_metrics["test/exact_sm"]


def test_optimizer_options_given_on_resume_take_effect(tmp_path):
    _fit(tmp_path, "r", extra=["--optimizer.lr", "1e-3"])
    run_dir = tmp_path / "r"
    resumed = main(["fit", "--config", str(run_dir / "config.yaml"), "--trainer.max_epochs", "2",
                    "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt"), "--optimizer.lr", "5e-3"])
    assert resumed.trainer.optimizers[0].param_groups[0]["lr"] == 5e-3
    # the restored Adam state (step counts) was kept: the option changed, not the optimiser
    assert all(s["step"] == 6 for s in resumed.trainer.optimizers[0].state.values())


def test_a_checkpoint_of_another_architecture_is_refused_naming_both_values(tmp_path, capsys):
    _fit(tmp_path, "r")
    ckpt = tmp_path / "r" / "checkpoints" / "last.ckpt"
    before = _tree(tmp_path)
    assert run(["fit", *tiny_args(tmp_path, "configs/nice/deq.yaml", "r2"), "--ckpt_path", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "model.init_args.net.init_args.m_net: checkpoint 'explicit', config 'deq'" in err
    assert run(["test", *tiny_args(tmp_path, EXPLICIT, "r"), "--ckpt_path", str(ckpt),
                "--data.init_args.transform", "logit", "--model.init_args.net.init_args.hidden", "13"]) == 2
    err = capsys.readouterr().err
    assert "data.init_args.transform: checkpoint 'logit_squeeze', config 'logit'" in err
    assert "model.init_args.net.init_args.hidden: checkpoint 12, config 13" in err
    assert _tree(tmp_path) == before  # nothing written


def test_deq_solver_options_may_differ_from_the_checkpoint(tmp_path):
    _fit(tmp_path, "d", config="configs/nice/deq.yaml")
    run_dir = tmp_path / "d"
    cli = main(["test", "--config", str(run_dir / "config.yaml"), "--ckpt_path",
                str(run_dir / "checkpoints" / "last.ckpt"),
                "--model.init_args.net.init_args.deq.init_args.solver", "anderson",
                "--model.init_args.net.init_args.deq.init_args.tol", "1e-6",
                "--model.init_args.net.init_args.deq.init_args.max_iter", "100"])
    deq = cli.model.deq_layers()[0]
    assert (deq.solver, deq.tol, deq.max_iter) == ("anderson", 1e-6, 100)
    assert cli.trainer.callback_metrics["test/deq/converged"] == 1


# ---------------------------------------------------------------------------------------------- run directories


def test_a_fresh_run_into_an_existing_run_is_refused_and_changes_nothing(tmp_path, capsys):
    _fit(tmp_path, "r")
    before = _tree(tmp_path)
    assert run(["fit", *tiny_args(tmp_path, EXPLICIT, "r")]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite_run true" in err and "--ckpt_path" in err
    assert _tree(tmp_path) == before


class FailsAtFirstBatch(pl.Callback):
    """A crash at the first training batch (after the run directory holds its config and logs), before any
    checkpoint."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        raise RuntimeError("this run fails at its first batch")


def test_a_fresh_run_that_fails_before_its_first_checkpoint_leaves_nothing_in_the_way(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="fails at its first batch"):
        _fit(tmp_path, "r", extra=[f"--trainer.callbacks+={__name__}.FailsAtFirstBatch"])
    moved = tmp_path / "r.failed-1"  # what the launch wrote, kept and named beside the free run name
    assert not (tmp_path / "r").exists() and (moved / "config.yaml").is_file() and not list(moved.rglob("*.ckpt"))
    assert f"moved to {moved}" in capsys.readouterr().err
    _fit(tmp_path, "r")  # launched again: not refused as a directory that holds a run
    assert (tmp_path / "r" / "checkpoints" / "last.ckpt").is_file()


def test_the_refusal_of_a_fresh_run_names_only_a_checkpoint_that_exists(tmp_path):
    from deqscore.errors import ConfigError
    from deqscore.lightning.runs import prepare_fresh_run

    run_dir = tmp_path / "r"  # a run killed before its first checkpoint (kill -9 leaves it so)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed_everything: 0\n")
    with pytest.raises(ConfigError) as refused:
        prepare_fresh_run(run_dir, overwrite=False)
    assert "holds no checkpoint to resume from" in str(refused.value) and ".ckpt" not in str(refused.value)
    assert "--overwrite_run true" in str(refused.value)
    (run_dir / "checkpoints").mkdir()
    last, interrupted = run_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "interrupted.ckpt"
    last.write_bytes(b"1")
    with pytest.raises(ConfigError, match=f"resume it with --ckpt_path {last}"):
        prepare_fresh_run(run_dir, overwrite=False)
    interrupted.write_bytes(b"2")  # a preemption after the last regular checkpoint: the newer one resumes
    os.utime(last, ns=(10**18, 10**18))
    os.utime(interrupted, ns=(2 * 10**18, 2 * 10**18))
    with pytest.raises(ConfigError, match=f"resume it with --ckpt_path {interrupted}"):
        prepare_fresh_run(run_dir, overwrite=False)


def test_overwrite_run_moves_the_old_run_aside_whole(tmp_path):
    _fit(tmp_path, "r")
    old = _tree(tmp_path / "r")
    _fit(tmp_path, "r", extra=["--overwrite_run", "true", "--optimizer.lr", "3e-3"])
    assert _tree(tmp_path / "r.1") == old  # the previous run, untouched, beside the new one
    assert (tmp_path / "r" / "checkpoints" / "last.ckpt").is_file()
    assert _tree(tmp_path / "r")["checkpoints/last.ckpt"] != old["checkpoints/last.ckpt"]
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir() if "last" in p.name) == ["last.ckpt"]


def test_a_run_directory_in_use_is_refused(tmp_path, capsys):


    with RunLock(tmp_path / "r"):
        assert run(["fit", *tiny_args(tmp_path, EXPLICIT, "r"), "--trainer.fast_dev_run", "1"]) == 2
    assert f"is in use by process {os.getpid()}" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    with RunLock(tmp_path / "r"):  # released: it can be taken again
        pass


# ---------------------------------------------------------------------------------------------- atomic checkpoints


def test_a_failed_checkpoint_save_keeps_the_previous_file_and_leaves_no_partial_one(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "best.ckpt"
    io.save_checkpoint({"w": torch.arange(5)}, target)
    good = target.read_bytes()

    def disk_full(obj, f):
        f.write(b"x" * 100)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"w": torch.arange(10)}, target)
    assert target.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["best.ckpt"]
    monkeypatch.undo()
    assert torch.equal(torch.load(target)["w"], torch.arange(5))


def test_training_writes_checkpoints_through_the_atomic_writer(tmp_path):
    cli = _fit(tmp_path, "r")
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert not list((tmp_path / "r" / "checkpoints").glob(".*tmp*"))


# ---------------------------------------------------------------------------------------------- true logs, Ctrl-C


def test_a_resume_after_a_crash_logs_every_step_once(tmp_path):
    _fit(tmp_path, "r")
    run_dir = tmp_path / "r"
    shutil.copy(run_dir / "checkpoints" / "last.ckpt", tmp_path / "epoch1.ckpt")
    resume = ["fit", "--config", str(run_dir / "config.yaml"), "--trainer.max_epochs", "2"]
    main([*resume, "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt")])
    # as if killed after logging epoch 2 but before its checkpoint: resume from the epoch-1 state again
    main([*resume, "--ckpt_path", str(tmp_path / "epoch1.ckpt")])
    steps = [s for s, _ in read_metrics_csv(run_dir / "metrics.csv")["train/loss"]]
    assert steps == list(range(6))
    val_steps = [s for s, _ in read_metrics_csv(run_dir / "metrics.csv")["val/loss"]]
    assert len(val_steps) == len(set(val_steps)) == 2


class InterruptAtStep2(pl.Callback):
    """Ctrl-C at global step 2, once per test (the resumed run's saved config carries this callback too)."""

    fired = False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 2 and not InterruptAtStep2.fired:
            InterruptAtStep2.fired = True
            raise KeyboardInterrupt


def test_ctrl_c_saves_a_resumable_checkpoint_of_the_interrupted_state(tmp_path, monkeypatch):
    monkeypatch.setattr(InterruptAtStep2, "fired", False)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            _fit(tmp_path, "r", 2, extra=[f"--trainer.callbacks+={__name__}.InterruptAtStep2"])
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT while it shuts down
    saved = tmp_path / "r" / "checkpoints" / "interrupted.ckpt"
    assert torch.load(saved, weights_only=False)["global_step"] == 2
    resumed = main(["fit", "--config", str(tmp_path / "r" / "config.yaml"), "--trainer.max_epochs", "2",
                    "--ckpt_path", str(saved)])
    assert resumed.trainer.global_step == 6
    assert not (tmp_path / ".r.lock").exists()  # the lock died with the interrupted run


# ---------------------------------------------------------------------------------------------- run identity


def _resume(run_dir, *extra, subcommand="fit"):
    """The README's resume command for the run in ``run_dir`` (its own config.yaml and last.ckpt)."""
    return run([subcommand, *extra, "--config", str(run_dir / "config.yaml"), "--ckpt_path",
                str(run_dir / "checkpoints" / "last.ckpt"), "--trainer.max_epochs", "2"])


def test_a_run_moved_aside_resumes_where_it_lives_and_the_new_run_under_its_old_name_is_unchanged(tmp_path):
    _fit(tmp_path, "r")
    (tmp_path / "r").rename(tmp_path / "r.1")  # moved aside by hand, then a new run takes the name
    _fit(tmp_path, "r", extra=["--optimizer.lr", "3e-3"])
    new_run = _tree(tmp_path / "r")
    assert _resume(tmp_path / "r.1") == 0
    assert _resume(tmp_path / "r.1", subcommand="test") == 0
    assert _tree(tmp_path / "r") == new_run  # every file of the other run, byte for byte
    moved = tmp_path / "r.1"
    assert torch.load(moved / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 1
    assert "run_name: r.1" in (moved / "config.yaml").read_text()
    # the checkpoint callbacks carried their state over: last.ckpt replaced in place (no last-v1.ckpt beside
    # it), the best-val/loss file of epoch 0 replaced by epoch 1's
    names = {p.name for p in (moved / "checkpoints").iterdir()}
    assert {"last.ckpt", "epoch=1-step=6.ckpt"} <= names and not {"last-v1.ckpt", "epoch=0-step=3.ckpt"} & names
    assert [s for s, _ in read_metrics_csv(moved / "metrics.csv")["train/loss"]] == list(range(6))


def test_a_copied_run_resumes_in_the_copy_and_leaves_the_original_unchanged(tmp_path, capsys):
    _fit(tmp_path, "r")
    shutil.copytree(tmp_path / "r", tmp_path / "c")
    original = _tree(tmp_path / "r")
    # --run_name before --config: the copied config.yaml's run name (r) and logger directories come after it
    assert _resume(tmp_path / "c", "--run_name", "c") == 0
    assert _tree(tmp_path / "r") == original
    assert torch.load(tmp_path / "c" / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 1
    capsys.readouterr()
    # a run name that is not the checkpoint's directory is refused, naming both directories; nothing written
    before = _tree(tmp_path)
    assert _resume(tmp_path / "c", "--run_name", "r") == 2
    err = capsys.readouterr().err
    assert f"belongs to the run in {tmp_path / 'c'}" in err and f"the run directory {tmp_path / 'r'}" in err, err
    assert "Traceback" not in err and _tree(tmp_path) == before


def test_a_checkpoint_kept_outside_any_run_continues_its_own_run_and_never_another(tmp_path, capsys):
    _fit(tmp_path, "r")
    _fit(tmp_path, "other", extra=["--optimizer.lr", "3e-3"])
    foreign, own = tmp_path / "foreign.ckpt", tmp_path / "own.ckpt"  # kept outside any run directory
    shutil.copy(tmp_path / "other" / "checkpoints" / "last.ckpt", foreign)
    shutil.copy(tmp_path / "r" / "checkpoints" / "last.ckpt", own)
    before = _tree(tmp_path / "r")
    args = ["fit", *tiny_args(tmp_path, EXPLICIT, "r"), "--trainer.max_epochs", "2", "--ckpt_path", str(foreign)]
    assert run(args) == 2  # another run's checkpoint into r: refused, nothing written
    err = capsys.readouterr().err
    assert "is not a checkpoint of the run in" in err and "--overwrite_run true" in err and "Traceback" not in err
    assert _tree(tmp_path / "r") == before
    # r's own checkpoint kept elsewhere continues r (the identity every checkpoint carries)
    assert run(["fit", *tiny_args(tmp_path, EXPLICIT, "r"), "--trainer.max_epochs", "2", "--ckpt_path", str(own)]) == 0
    assert torch.load(tmp_path / "r" / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 1
    assert run(["fit", *tiny_args(tmp_path, EXPLICIT, "fresh"), "--trainer.max_epochs", "2", "--ckpt_path",
                str(foreign)]) == 0  # a directory of its own: a run continuing from the checkpoint's epoch
    assert torch.load(tmp_path / "fresh" / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 1
    continued = _tree(tmp_path / "r")
    assert run([*args, "--overwrite_run", "true"]) == 0  # or r moved aside, whole
    assert _tree(tmp_path / "r.1") == continued


def test_a_checkpoint_dirpath_in_another_run_is_refused(tmp_path, capsys):
    _fit(tmp_path, "a")
    callbacks = load_config(ROOT / EXPLICIT)["trainer"]["callbacks"]

    def fit_b(dirpath):  # the config's first ModelCheckpoint writing to dirpath (a config given after the first)
        callbacks[0]["init_args"]["dirpath"] = str(dirpath)
        extra = tmp_path / "dirpath.yaml"
        extra.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
        return run(["fit", *tiny_args(tmp_path, EXPLICIT, "b"), "--config", str(extra)])

    before = _tree(tmp_path / "a")
    assert fit_b(tmp_path / "a" / "checkpoints") == 2
    err = capsys.readouterr().err
    assert f"ModelCheckpoint dirpath {tmp_path / 'a' / 'checkpoints'} lies in the run directory" in err, err
    assert "holds a run" in err and "Traceback" not in err
    assert _tree(tmp_path / "a") == before and not (tmp_path / "b").exists()
    with RunLock(tmp_path / "busy"):  # a run directory another process holds, before it has written anything
        assert fit_b(tmp_path / "busy" / "checkpoints") == 2
        assert f"is in use by process {os.getpid()}" in capsys.readouterr().err
    assert fit_b(tmp_path / "elsewhere") == 0  # a folder outside every run
    assert (tmp_path / "elsewhere" / "last.ckpt").is_file()


# ---------------------------------------------------------------------------------------------- unwritable runs root


def test_a_runs_root_that_is_a_file_is_one_message_naming_it(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    before = _tree(tmp_path)
    assert run(["fit", *tiny_args(tmp_path, EXPLICIT, "r"), "--runs_root", str(tmp_path / "file" / "runs")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'file'} is not a directory" in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and _tree(tmp_path) == before


def test_a_runs_root_that_cannot_be_written_is_one_message_naming_it(tmp_path, capsys, monkeypatch):
    def denied(*args, **kwargs):  # what creating a file in a read-only directory gives a user who is not root
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files.tempfile, "TemporaryFile", denied)
    assert run(["fit", *tiny_args(tmp_path, EXPLICIT, "r"), "--runs_root", str(tmp_path / "ro" / "runs")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write in {tmp_path} (Permission denied); choose another --runs_root" in err, err
    assert "Traceback" not in err and err.count("\n") == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only directories")
def test_a_read_only_runs_root_is_one_message_naming_it(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        assert run(["fit", *tiny_args(tmp_path, EXPLICIT, "r"), "--runs_root", str(locked)]) == 2
    finally:
        locked.chmod(0o755)
    err = capsys.readouterr().err
    assert f"cannot write in {locked}" in err and "Traceback" not in err, err
