"""The GPU program's step rows: one training step (loss, backward, Adam update) of every family's explicit and DEQ
network, eager and compiled, with its CUDA peak memory and the DEQ-over-explicit ratios.

Each family's network is built from its declared configs (the ``shallow`` and ``deq`` roles of
:mod:`deqscore.families`) at the sizes, batch, inputs and loss of the depth entry of its DEQ config (the same entry
the depth section measures), so that a row here and a row there describe the same step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from deqscore.families import declarations
from deqscore.metrics import parameter_count

from .configs import build
from .depth import INPUTS, LOSSES
from .entries import DEPTHS, Depth
from .measure import MIB, log, wall
from .report import Column, Table, ratio_cells

ROLES = (("explicit", "shallow"), ("DEQ", "deq"))
GPU_BATCH = 128  # at least this batch on the GPU (the depth entries' CPU batches are smaller for some families)


@dataclass(frozen=True)
class StepPlan:
    """How the step rows run: sizes mode, timed steps, the compile backend and the stage's time budget."""

    mode: str  # "full" or "quick" (the depth entries' sizes)
    repeats: int
    backend: str  # torch.compile's backend: "inductor" on the GPU, "eager" (tracing only) in the quick CPU run
    budget_s: float  # no new row starts after this many seconds of the stage


def family_entries() -> list[tuple[str, str, Depth]]:
    """(family, explicit config, depth entry of the DEQ config) for every declared family that has both."""
    out = []
    for name, declared in declarations().items():
        if "shallow" not in declared.configs or "deq" not in declared.configs:
            continue
        deq_config = declared.config("deq")
        entry = next((e for e in DEPTHS.get(name, {}).values() if e.config == deq_config), None)
        if entry is not None:
            out.append((name, declared.config("shallow"), entry))
    return out


def one_line(err: BaseException) -> str:
    """``failed: <type>: <first line>`` of an exception, for a table cell."""
    first = (str(err).strip().splitlines() or [""])[0][:160]
    return f"failed: {type(err).__name__}: {first}"


def _median_ms(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    return 1e3 * statistics.median(wall(step, device)[1] for _ in range(repeats))


def _peak_mib(step: Callable[[], None], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / MIB


class StepRow:
    """One network's step: built once, measured eager (:meth:`eager`) and compiled (:meth:`compiled`)."""

    def __init__(self, family: str, label: str, config: str, entry: Depth, plan: StepPlan, device: torch.device):
        self.module = build(config, entry.sizes[plan.mode])
        batch = entry.batch[plan.mode] if plan.mode == "quick" else max(entry.batch[plan.mode], GPU_BATCH)
        x = INPUTS[entry.inputs](self.module, batch, torch.Generator().manual_seed(0))  # DKEF: centres from x
        self.module, self.x = self.module.train(), x.to(device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.loss_fn, self.plan, self.device = LOSSES[entry.loss], plan, device
        self.row: dict = {"family": family, "network": label, "config": config, "batch": batch,
                          "params": parameter_count(self.module)}

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        """The network and a fresh Adam on the device only while it is measured, so that the CUDA peak is this
        network's alone."""
        self.module.to(self.device)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=1e-4)
        try:
            yield
        finally:
            self.optimizer = None
            self.module.zero_grad(set_to_none=True)
            self.module.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _step(self, fn: Callable) -> Callable[[], None]:
        def step() -> None:
            assert self.optimizer is not None
            self.optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(0)  # the same noise, levels and projections in every step
            fn(self.module, self.x).backward()
            self.optimizer.step()
        return step

    def eager(self) -> None:
        step = self._step(self.loss_fn)
        with self._on_device():
            wall(step, self.device)  # warm-up (cuDNN autotuning, allocator)
            self.row["eager_ms"] = _median_ms(step, self.device, self.plan.repeats)
            self.row["eager_peak_mib"] = _peak_mib(step, self.device)
        log(f"gpu steps: {self.row['family']} {self.row['network']}: eager {self.row['eager_ms']:.2f} ms")

    def compiled(self) -> None:
        try:
            step = self._step(torch.compile(self.loss_fn, backend=self.plan.backend))
            with self._on_device():
                self._compiled(step)
        except Exception as err:  # noqa: BLE001 - a config that does not compile is a result, in one line
            self.row["compiled_ms"] = one_line(err)
        finally:
            torch._dynamo.reset()
        log(f"gpu steps: {self.row['family']} {self.row['network']}: compiled {self.row['compiled_ms']}")

    def _compiled(self, step: Callable[[], None]) -> None:
        self.row["compile_s"] = wall(step, self.device)[1]
        wall(step, self.device)  # a second call: recompilations for the steady state happen here
        self.row["compiled_ms"] = _median_ms(step, self.device, self.plan.repeats)
        self.row["compiled_peak_mib"] = _peak_mib(step, self.device)


def ratio_row(explicit: dict, deq: dict) -> dict:
    keys = ("params", "eager_ms", "eager_peak_mib", "compiled_ms", "compiled_peak_mib")
    numeric = {k: v for k, v in deq.items() if not isinstance(v, str)}
    reference = {k: v for k, v in explicit.items() if not isinstance(v, str)}
    return {"family": deq["family"], "network": "ratio DEQ / explicit", **ratio_cells(numeric, reference, keys)}


def step_table(plan: StepPlan, device: torch.device) -> Table:
    """The step rows of every family (a row not started within the stage's budget says so)."""
    table = Table("steps", "Training step per family: eager and compiled, CUDA peak memory", [
        Column("family", "family"), Column("network", "network"), Column("batch", "batch"),
        Column("params", "parameters", ","), Column("eager_ms", "eager step (ms)", ".2f"),
        Column("eager_peak_mib", "eager CUDA peak (MiB)", ".1f"), Column("compile_s", "compile (s)", ".1f"),
        Column("compiled_ms", "compiled step (ms)", ".2f"),
        Column("compiled_peak_mib", "compiled CUDA peak (MiB)", ".1f"),
    ])
    start = time.perf_counter()
    measured: list[StepRow] = []
    rows: list[dict] = []
    for family, explicit_config, entry in family_entries():  # eager first: every family's, cheap
        for label, role in ROLES:
            config = entry.config if role == "deq" else explicit_config
            try:
                step = StepRow(family, label, config, entry, plan, device)
                rows.append(step.row)
                step.eager()
                measured.append(step)
            except Exception as err:  # noqa: BLE001 - one network's failure leaves the others' rows
                if not rows or rows[-1].get("network") != label or rows[-1].get("family") != family:
                    rows.append({"family": family, "network": label, "config": config})
                rows[-1]["eager_ms"] = one_line(err)
    for step in measured:  # then compiled, while the stage's budget lasts
        if time.perf_counter() - start > plan.budget_s:
            step.row["compiled_ms"] = f"skipped: stage budget {plan.budget_s:.0f} s spent"
        else:
            step.compiled()
    for family, _, _ in family_entries():
        pair = {r["network"]: r for r in rows if r["family"] == family}
        table.rows += list(pair.values())
        if "explicit" in pair and "DEQ" in pair:
            table.rows.append(ratio_row(pair["explicit"], pair["DEQ"]))
    table.notes += [
        "One training step: the family's loss (as its depth entry measures it: the module's loss, or the VAE's score "
        "network loss), its backward and an Adam update, the same draws each step; the median of "
        f"{plan.repeats} steps after a warm-up. Networks from the families' `shallow` and `deq` configs at the depth "
        f"entries' {plan.mode} sizes, batch at least {GPU_BATCH} on the GPU, float32 (TF32 matmuls allowed).",
        f"Compiled: `torch.compile(loss, backend='{plan.backend}')` (the backward through AOTAutograd); compile (s) "
        "is the first call's time. A config that does not compile has its one-line error in the cell.",
        "CUDA peak: `torch.cuda.max_memory_allocated` over one step (parameters, Adam state and gradients included).",
    ]
    return table
