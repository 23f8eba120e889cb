"""A collective that failed because another process of the run died or stopped answering, told in one line.

Under DDP every process waits for the others in each collective. When one dies (killed by the out-of-memory
killer, its node lost) the others get the backend's transport error ("Connection reset by peer" from gloo, a
watchdog abort from NCCL), which says neither that a rank was lost nor which. The first process of a node
launched its other local ranks (Lightning's launcher) and can ask them; a process whose launcher died knows that
rank 0 was lost. A rank that is alive but stuck makes the others wait until the process-group timeout
(``--process_group_timeout``), after which the first process stops its local ranks that are still running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

# Text of the transport errors of a collective whose peer is gone or silent (gloo, NCCL and c10d's store).
LOST_PEER_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out waiting",
                     "timed out", "Timeout", "NCCL", "gloo")


class LostRankError(RuntimeError):
    """A collective failed because another process of the run died or stopped answering."""


def is_lost_peer(err: BaseException) -> bool:
    """``err`` is a collective's failure (a ``DistError``, or a RuntimeError raised by the gloo or NCCL transport)."""
    if isinstance(err, torch.distributed.DistError):
        return True
    return type(err) is RuntimeError and any(marker in str(err) for marker in LOST_PEER_MARKERS)


def leave_process_group() -> None:
    """Destroy this process's process group, if it has one, before the process exits. Left to the interpreter's
    exit, the group's C++ teardown races the interpreter's own: a rank of a finished run can abort there
    ("terminate called without an active exception", SIGABRT), and Lightning's launcher then kills every rank,
    so a run that trained to its end exits with an error."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _exit_text(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (" (the out-of-memory killer's signal)" if name == "SIGKILL" else "")
    return f"exited with status {code}"


def local_ranks(strategy: Any) -> list[tuple[int, subprocess.Popen]]:
    """(global rank, process) of the ranks this process launched on its node (none unless it is a node's first)."""
    procs = getattr(getattr(strategy, "launcher", None), "procs", None) or []
    first = getattr(strategy, "node_rank", 0) * getattr(strategy, "num_processes", len(procs) + 1)
    return [(first + local, proc) for local, proc in enumerate(procs, start=1)]


def transport_text(err: BaseException, budget: int = 240) -> str:
    """The backend's own words for a failed collective: the first line of ``err`` without gloo's source location
    (``[.../pair.cc:538] ``), in whole sentences: the first always, the next ones while they fit in ``budget``
    characters (gloo's second sentence says what typically causes the failure)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", first)
    sentences = re.split(r"(?<=\.)\s+(?=[A-Z])", text)
    kept = sentences[0]
    for sentence in sentences[1:]:
        if len(kept) + 1 + len(sentence) > budget:
            break
        kept += " " + sentence
    return kept


def parent_lost(parent_pid: int, wait_s: float = 2.0) -> bool:
    """Whether this process's parent ``parent_pid`` has died: it has been given another parent. A killed parent
    closes its sockets before its children are given another one, so a collective can fail on its death a moment
    before :func:`os.getppid` shows it: wait up to ``wait_s`` for the change (a live parent costs that wait once,
    on an error that ends the run anyway)."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def lost_rank_message(err: BaseException, strategy: Any, launcher_lost: bool, timeout_s: float,
                      checkpoint: str | Path | None) -> str | None:
    """One line for a collective's failure: which ranks died (and how) or did not answer, what was done about
    them, and the checkpoint to resume from (None: the run had saved none); None when this process cannot tell more
    than the error does and should stay quiet (a rank other than the first, whose launcher is alive: the first
    process reports)."""
    died, stuck = [], []
    for rank, proc in local_ranks(strategy):
        code = proc.poll()
        if code is None:
            stuck.append((rank, proc))
        else:
            died.append(f"rank {rank} (pid {proc.pid}) {_exit_text(code)}")
    for _, proc in stuck:  # alive but not answering: stopped, so that nothing of the run is left on the node
        proc.kill()
    if died:
        what = "; ".join(died)
    elif launcher_lost:
        what = "rank 0 (this process's launcher) was lost"
    elif stuck:
        what = ", ".join(f"rank {rank} (pid {proc.pid})" for rank, proc in stuck) + \
            f" did not answer within the process-group timeout ({timeout_s:g} s) and was stopped"
    elif getattr(strategy, "global_rank", 0) == 0:
        what = "a process on another node was lost or stopped answering (see its log)"
    else:
        return None
    after = (f"Its last checkpoint is kept: resume with --ckpt_path {checkpoint}" if checkpoint is not None else
             "It had saved no checkpoint yet: launch it again as it was")
    return f"{what}: the run stopped in a collective ({transport_text(err).rstrip('.')}). {after}"
