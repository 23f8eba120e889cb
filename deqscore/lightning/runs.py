"""Run directories that nothing overwrites by accident, checkpoint files that are complete or absent, and logs
that stay true across resumes.

* :class:`RunLock`: one process at a time per run directory (an ``flock`` held for the life of the run, released
  by the kernel even after ``kill -9``), taken by ``train.py`` for every subcommand.
* :func:`prepare_fresh_run`: a fresh ``fit`` into a directory that already holds a run is refused, or, when asked,
  the old run is moved aside whole; nothing is ever deleted.
* :class:`AtomicCheckpointIO`: a checkpoint is written to a temporary file in its own directory, synced and renamed
  over the target, so a full disk or a crash leaves the previous file intact and no partial file behind.
* :func:`truncate_log_after`: a resumed run drops the CSV rows logged after its checkpoint (they are logged
  again), so every step appears once.
"""

from __future__ import annotations

import csv
import fcntl
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning import Callback

from ..errors import ConfigError
from ..files import staged, unwritable
from ..privates import checkpoint_batches_that_stepped, saved_at_batch_end

#: files and folders that mark a directory as holding a run
RUN_MARKERS = ("checkpoints", "metrics.csv", "config.yaml", "hparams.yaml")


class RunInUseError(ConfigError):
    """Another process holds the run directory."""


def lock_path(run_dir: Path) -> Path:
    """The lock file of ``run_dir``: ``<runs_root>/.<run_name>.lock``, beside the run, so the run can be moved aside
    while it is held."""
    return Path(run_dir).parent / f".{Path(run_dir).name}.lock"


def _holder(fd: int) -> str:
    """The pid a lock's holder wrote into the lock file open as ``fd``."""
    return os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"


class RunLock:
    """Exclusive lock of a run directory (:func:`lock_path`); ``remedy`` ends the refusal's message (what the
    command that met another holder can do)."""

    def __init__(self, run_dir: Path, remedy: str = "wait for it to finish or choose another --run_name"):
        self.run_dir = Path(run_dir)
        self.remedy = remedy
        self.path = lock_path(self.run_dir)
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunInUseError(
                f"run directory {self.run_dir} is in use by process {holder}; {self.remedy}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still held: no other process can have taken it meanwhile
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def check_writable_run_dir(run_dir: Path) -> None:
    """Raise :class:`ConfigError` naming the path unless ``run_dir`` and its runs root (which holds the lock beside
    it) are, or can be created as, directories this process can write in. Creates nothing (a probe file in an
    existing directory is removed at once)."""
    run_dir = Path(run_dir)
    for path in dict.fromkeys((run_dir.parent, run_dir)):
        problem = unwritable(path)
        if problem is None:
            continue
        existing, reason = problem
        if reason == "not a directory":
            raise ConfigError(f"cannot create the run directory {run_dir}: {existing} is not a directory")
        raise ConfigError(f"cannot write the run directory {run_dir}: cannot write in {existing} ({reason}); "
                          "choose another --runs_root or --run_name")


def holds_a_run(run_dir: Path) -> list[str]:
    """The run markers present in ``run_dir`` (empty: a fresh directory)."""
    return [m for m in RUN_MARKERS if (Path(run_dir) / m).exists()]


RUN_ID_FILE = "run_id"  # in a run directory: the identity its checkpoints carry
RUN_ID_KEY = "deqscore_run_id"  # in a checkpoint
LOG_STEP_KEY = "deqscore_log_step"  # in a checkpoint: the step a resume from it logs its first batch at


def run_id(run_dir: Path, create: bool = False) -> str | None:
    """The identity of the run in ``run_dir`` (a random hex string written when the run starts), or None for a
    directory without one (a fresh one, unless ``create``; or a run older than run identities)."""
    path = Path(run_dir) / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip() or None
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    identity = uuid.uuid4().hex
    with staged([path]) as (tmp,):
        tmp.write_text(identity + "\n")
    return identity


class RunIdentity(Callback):
    """Writes the run's identity (:func:`run_id`) into every checkpoint, so a checkpoint kept outside its run
    directory can still be told to belong to it."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        identity = run_id(self.run_dir)
        if identity is not None:
            checkpoint[RUN_ID_KEY] = identity


def lock_holder(run_dir: Path) -> str | None:
    """The process holding ``run_dir``'s :class:`RunLock` (its pid as written), or None when it is free."""
    path = lock_path(run_dir)
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)  # closing drops a shared lock taken above


def check_checkpoint_dirpath(dirpath: str | Path, run_dir: Path) -> None:
    """Raise :class:`ConfigError` when a checkpoint callback's own ``dirpath`` lies in another run's directory (one
    that holds a run, or that another process holds): its checkpoints would land among that run's files."""
    target, own = Path(dirpath).resolve(), Path(run_dir).resolve()
    if target == own or own in target.parents:
        return
    for other in (target, target.parent):  # the folder itself, or a folder of it (a run's checkpoints/)
        holder = lock_holder(other)
        # what train.py writes into every run: its config and a checkpoints folder or a log
        found = [m for m in holds_a_run(other) if m != "hparams.yaml"] if (other / "config.yaml").is_file() else []
        if holder is not None or len(found) > 1:
            why = f"is in use by process {holder}" if holder is not None else f"holds a run ({', '.join(found)})"
            raise ConfigError(
                f"ModelCheckpoint dirpath {dirpath} lies in the run directory {other}, which {why}; leave dirpath "
                f"out (checkpoints then go to {run_dir / 'checkpoints'}) or choose a folder outside every run")


def checkpoint_run_dir(ckpt_path: str | Path) -> Path | None:
    """The run directory that holds ``ckpt_path`` (``<run>/checkpoints/<file>.ckpt``: the layout every run writes),
    or None for a checkpoint kept elsewhere."""
    path = Path(ckpt_path)
    if path.parent.name != "checkpoints":
        return None
    run_dir = path.parent.parent
    return run_dir if run_dir.name not in ("", ".", "..") else run_dir.absolute().resolve()


def move_aside(run_dir: Path, tag: str = "") -> Path:
    """Rename ``run_dir`` to the first free ``<run_dir>.<tag><n>``; returns the new path."""
    n = 1
    while run_dir.with_name(f"{run_dir.name}.{tag}{n}").exists():
        n += 1
    return run_dir.rename(run_dir.with_name(f"{run_dir.name}.{tag}{n}"))


def resume_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint the run in ``run_dir`` resumes from: the newer of ``checkpoints/interrupted.ckpt`` and
    ``checkpoints/last.ckpt``, else its newest checkpoint; None when it holds none (it stopped before its first)."""
    folder = Path(run_dir) / "checkpoints"
    found = [p for p in (folder / "interrupted.ckpt", folder / "last.ckpt") if p.is_file()] or (
        sorted(folder.glob("*.ckpt")) if folder.is_dir() else [])
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def prepare_fresh_run(run_dir: Path, overwrite: bool) -> Path | None:
    """Refuse a fresh run in a directory holding one, unless ``overwrite``: then move the old run aside whole and
    return where it went. The refusal names the checkpoint to resume from, and only one that exists."""
    found = holds_a_run(run_dir)
    if not found:
        return None
    if not overwrite:
        resume = resume_checkpoint(run_dir)
        what = (f"resume it with --ckpt_path {resume}" if resume is not None else
                "it holds no checkpoint to resume from (it stopped before its first)")
        raise ConfigError(
            f"run directory {run_dir} already holds a run ({', '.join(found)}); {what}, choose another --run_name, "
            f"or pass --overwrite_run true to move the old run aside (to {run_dir}.<n>)"
        )
    return move_aside(run_dir)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file beside its target, syncs it and renames it over the target."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with staged([path]) as (tmp,), open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())


def checkpoint_log_step(ckpt: dict[str, Any]) -> int:
    """The logging step a run resumed from ``ckpt`` continues at: as recorded when it was saved
    (:class:`~deqscore.lightning.run_hooks.ResumeFixes`), else read from its loop state (Lightning's count of
    optimizer-stepping batches, plus the batch a checkpoint saved at a batch's end does not count yet)."""
    if LOG_STEP_KEY in ckpt:
        return int(ckpt[LOG_STEP_KEY])
    return checkpoint_batches_that_stepped(ckpt) + saved_at_batch_end(ckpt)


def truncate_log_after(csv_path: Path, step: int) -> int:
    """Drop the rows of ``csv_path`` logged at ``step`` or later; returns how many were dropped."""
    if not csv_path.is_file():
        return 0
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames or [], list(reader)
    kept = [r for r in rows if not r.get("step") or int(r["step"]) < step]
    if len(kept) == len(rows):
        return 0
    with staged([csv_path]) as (tmp,), open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(kept)
    return len(rows) - len(kept)
