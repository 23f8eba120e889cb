"""Measurement helpers: environment, inputs, the SSM step, activation memory and wall-clock timing."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from deqscore.losses import score_from_log_prob, sliced_score_matching
from deqscore.metrics import step_activation_bytes

from .settings import MNIST_DIM, Settings

MIB = 2**20


def log(msg: str) -> None:
    """One progress line."""
    print(f"[bench] {msg}", flush=True)


def device_name(device: torch.device) -> str:
    """GPU name, or the CPU model from ``/proc/cpuinfo`` (``platform`` as fallback)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """1-minute load average and core count: timings on a shared machine are only as good as this."""
    try:
        return f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    except OSError:
        return "unknown"


def environment(device: torch.device) -> dict:
    """Header lines: device, torch version, threads, date, machine load, the code's commit."""
    return {
        "device": f"{device.type}: {device_name(device)}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load average at start": load_average(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        # the CPU's vector instructions choose torch's kernels, so the order of their sums: one CPU model name
        # (an "AMD EPYC") covers machines whose same-seed runs differ
        "cpu instructions": torch.backends.cpu.get_cpu_capability(),
        "code": code_text(code_version()),
    }


def code_text(code: dict | None) -> str:
    """:func:`code_version` as one header line."""
    if code is None:
        return "not a git checkout"
    if not code["uncommitted_changes"]:
        return f"commit {code['commit']}"
    return f"commit {code['commit']} with uncommitted changes (SHA-256 {code['changes_sha256'][:12]})"


CODE_PATHS = ("deqscore", "lab", "configs", "train.py", "sample.py")  # what a run's figures come from


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def code_version() -> dict | None:
    """The commit of the git checkout the package runs from, and whether its code or configs then differed from it
    (figures of such a run come from code that no commit holds); None outside a git checkout."""
    try:
        commit = _git("rev-parse", "HEAD").strip()
        changed = _git("status", "--porcelain", "--", *CODE_PATHS).strip()
        if not changed:
            return {"commit": commit, "uncommitted_changes": False}
        # the uncommitted changes themselves, by hash: two runs of one edited checkout are of the same code
        digest = hashlib.sha256(_git("diff", "HEAD", "--", *CODE_PATHS).encode())
        root = Path(__file__).resolve().parents[2]
        for name in _git("ls-files", "--others", "--exclude-standard", "--", *CODE_PATHS).split():
            digest.update(name.encode() + (root / name).read_bytes())
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "uncommitted_changes": True, "changes_sha256": digest.hexdigest()}


@functools.cache
def committed_as(commit: str, changes_sha256: str) -> str | None:
    """The commit after ``commit`` in this checkout's history whose code differs from ``commit`` by exactly the
    uncommitted changes a run recorded (:func:`code_version`'s SHA-256 of them, no new files among them): the
    commit that holds the code the run ran. None where none does, or git cannot tell."""
    try:
        for later in _git("rev-list", "--reverse", f"{commit}..HEAD").split():
            diff = _git("diff", commit, later, "--", *CODE_PATHS)
            if hashlib.sha256(diff.encode()).hexdigest() == changes_sha256:
                return later
    except (OSError, subprocess.CalledProcessError):
        return None
    return None


def changed_code(commit: str, other: str) -> list[str] | None:
    """The code files (:data:`CODE_PATHS`) that differ between two commits; None where git cannot tell (no
    checkout, a commit not in its history)."""
    try:
        return _git("diff", "--name-only", commit, other, "--", *CODE_PATHS).split()
    except (OSError, subprocess.CalledProcessError):
        return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """``fn()`` and its wall-clock seconds, synchronised on CUDA."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def n_repeats(settings: Settings, warmup_s: float) -> int:
    """``settings.repeats``, fewer when they would exceed the row budget (at least 1)."""
    return max(1, min(settings.repeats, int(settings.row_budget_s / max(warmup_s, 1e-9))))


def timed(fn: Callable[[], object], device: torch.device, settings: Settings) -> tuple[object, float, int]:
    """One warm-up call, then the median ms over the timed calls: ``(warm-up result, ms, n)``."""
    out, warm = wall(fn, device)
    n = n_repeats(settings, warm)
    times = [wall(fn, device)[1] for _ in range(n)]
    return out, 1e3 * statistics.median(times), n


@dataclass
class StepResult:
    """Activation memory (saved tensors, parameters excluded), CUDA peak, median step time, timed steps."""

    act_mib: float
    peak_mib: float | None
    time_ms: float
    repeats: int


def ssm_loss(log_prob: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The mean SSM loss of one training step (its backward is the rest of the step)."""
    return sliced_score_matching(score_from_log_prob(log_prob), x).mean()


def _clear_grads(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


def _peak_step(step: Callable[[], None], params: list[nn.Parameter], device: torch.device) -> tuple[float, float]:
    """Wall seconds of one step and the CUDA peak allocation (MiB, 0 on CPU) during it."""
    _clear_grads(params)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _, secs = wall(step, device)
    peak = torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else 0.0
    return secs, peak


def loss_step_bytes(module: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> int:
    """Activation memory (bytes) of one training step: ``loss_fn()`` (a scalar) and its backward, measured by the
    project's one meter, :func:`deqscore.metrics.step_activation_bytes` (which leaves gradients, buffers and the RNG
    as they were)."""

    def step() -> None:
        loss = loss_fn()
        if loss.requires_grad:
            loss.backward()

    return step_activation_bytes(step, module)


def measure_step(
    loss_fn: Callable[[], torch.Tensor], module: nn.Module, device: torch.device, settings: Settings
) -> StepResult:
    """Activation memory of one step, ``loss_fn()`` and its backward (:func:`loss_step_bytes`, which is also
    the warm-up), then the median time of the timed steps."""
    params = list(module.parameters())
    act_bytes, warm = wall(lambda: loss_step_bytes(module, loss_fn), device)
    n = n_repeats(settings, warm)
    runs = [_peak_step(lambda: loss_fn().backward(), params, device) for _ in range(n)]
    peak = max(p for _, p in runs) if device.type == "cuda" else None
    _clear_grads(params)
    return StepResult(act_bytes / MIB, peak, 1e3 * statistics.median(s for s, _ in runs), n)


def _mnist_batch(n: int, seed: int) -> torch.Tensor:
    """``n`` MNIST-test images in logit space (reference pre-processing), a seeded random subset."""
    from deqscore.data.mnist import load_mnist
    from deqscore.data.transforms import preprocess

    images, _ = load_mnist("datasets", train=False, sources=("torchvision", "pureml"))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(images), generator=gen)[:n]
    batch = torch.from_numpy(images[idx.numpy()]).reshape(n, -1)
    return preprocess(batch, "logit", generator=gen)


def make_inputs(
    n: int, dim: int, settings: Settings, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, str]:
    """Data ``[n, dim]``: logit-space MNIST when asked for and ``dim`` is 784, else N(0, 1); and its source."""
    if settings.inputs == "mnist" and dim == MNIST_DIM:
        try:
            return _mnist_batch(n, settings.seed).to(device, dtype), "MNIST-test, logit space"
        except (FileNotFoundError, ImportError) as err:
            log(f"MNIST unavailable ({type(err).__name__}); using N(0, 1) inputs")
    gen = torch.Generator().manual_seed(settings.seed)
    return torch.randn(n, dim, generator=gen).to(device, dtype), "N(0, 1)"


class CouplingDensity(nn.Module):
    """``log p(x) = -0.5 ||x1||^2 - 0.5 ||x2 - m(x1)||^2`` (+ const): one NICE additive coupling over a
    standard normal, with ``x1``/``x2`` the even/odd coordinates. Its score passes through the m-net ``m``."""

    def __init__(self, m_net: nn.Module):
        super().__init__()
        self.m = m_net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[:, 0::2], x[:, 1::2]
        return -0.5 * x1.pow(2).sum(1) - 0.5 * (x2 - self.m(x1)).pow(2).sum(1)
