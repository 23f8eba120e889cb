"""Section ``implicit``: the exact backward (``backward: implicit``, docs/method.md 2.9) against the phantom steps
and the explicit networks, per family, on the same batch.

For every family's depth entry (:class:`deqscore.families.Depth`: its DEQ config, sizes, batch, inputs and the
step it measures) one training step of

* the shallow and the deep explicit configs (the declaration's ``shallow`` and ``deep`` roles),
* the DEQ config with its own phantom steps K (the paper's), with the faithful K of the family's study variant
  ``deq_faithful`` where it has one, and with ``backward: implicit`` (DKEF's linear map: the direct solve),

all built at the entry's sizes and fed the same seeded batch: parameters, activation memory
(:func:`deqlab.measure.loss_step_bytes`), the CUDA peak on a GPU, the median step time, and each row's ratios to the
shallow explicit network.

Run::

    python -m deqlab --sections implicit --out benchmarks/results/implicit [--quick]
"""

from __future__ import annotations

import torch

from deqscore.deq import DEQ
from deqscore.families import declarations
from deqscore.metrics import parameter_count

from .configs import build
from .depth import INPUTS, LOSSES
from .entries import DEPTHS, STUDIES, Depth
from .measure import log, measure_step
from .report import Column, Table, ratio_cells
from .settings import Settings

PHANTOM_STEPS = "phantom_steps="


def faithful_steps(family: str) -> int | None:
    """K of the family's study variant ``deq_faithful`` (None: it has none)."""
    study = STUDIES.get(family)
    variant = study.variants.get("deq_faithful") if study else None
    if variant is None:
        return None
    return next(int(o.split(PHANTOM_STEPS)[1]) for o in variant.overrides if PHANTOM_STEPS in o)


def variants(family: str, entry: Depth) -> list[tuple[str, str, dict]]:
    """(label, config, options) of every row of ``family``'s entry."""
    configs = declarations()[family].configs
    root = "configs/" + family + "/"
    rows = [(f"explicit {role}", root + configs[role], {}) for role in ("shallow", "deep") if role in configs]
    deq = {**entry.deq_options, "net.deq.warn_on_nonconvergence": False}
    rows.append(("DEQ, phantom (config's K)", entry.config, deq))
    k = faithful_steps(family)
    if k is not None:
        rows.append((f"DEQ, phantom K = {k} (faithful)", entry.config, {**deq, "net.deq.phantom_steps": k}))
    rows.append(("DEQ, implicit", entry.config, {**deq, "net.deq.backward": "implicit"}))
    return rows


def row(entry: Depth, label: str, config: str, options: dict, s: Settings, device: torch.device) -> dict:
    module = build(config, {**entry.sizes[s.mode], **options}).to(device).train()
    x = INPUTS[entry.inputs](module, entry.batch[s.mode], torch.Generator().manual_seed(s.seed)).to(device)

    def loss() -> torch.Tensor:
        torch.manual_seed(s.seed)  # the same noise, projections and levels in every row and step
        return LOSSES[entry.loss](module, x)

    res = measure_step(loss, module, device, s)
    deqs = [m for m in module.modules() if isinstance(m, DEQ)]
    out = {"variant": label, "params": parameter_count(module), **vars(res),
           "phantom_steps": deqs[0].phantom_steps if deqs and deqs[0].backward == "phantom" else None,
           "solver_iters": deqs[0].stats.nstep if deqs else None}
    log(f"implicit: {entry.label}: {label}: {res.act_mib:.3f} MiB, {res.time_ms:.1f} ms")
    return out


def section(s: Settings, device: torch.device) -> Table:
    table = Table("implicit", "The exact backward (implicit) against phantom steps and explicit networks", [
        Column("family", "family"), Column("variant", "network"), Column("params", "parameters", ","),
        Column("act_mib", "activation memory (MiB)", ".3f"), Column("peak_mib", "CUDA peak (MiB)", ".1f"),
        Column("time_ms", "step time (ms)", ".1f"), Column("solver_iters", "forward solver iters", "d"),
        Column("act_ratio", "memory / shallow"), Column("time_ratio", "time / shallow"),
    ])
    for family in declarations():
        for entry in DEPTHS.get(family, {}).values():
            rows = [row(entry, *v, s, device) for v in variants(family, entry)]
            shallow = rows[0]
            for r in rows:
                ratios = ratio_cells(r, shallow, ("act_mib", "time_ms"))
                r.update(family=entry.label, act_ratio=ratios["act_mib"], time_ratio=ratios["time_ms"])
            table.rows += rows
    table.meta["sizes"] = {f: {n: {"options": e.sizes[s.mode], "batch": e.batch[s.mode]}
                               for n, e in DEPTHS.get(f, {}).items()} for f in declarations()}
    table.notes += [
        "Each row is its config's module (`build_module`) at the depth entry's sizes (`meta.sizes`), fed the same "
        "seeded batch; the step is the entry's loss (the VAE: the score network's SSM-VR step) and its backward. "
        "The DEQ rows use the DEQ config, with its own K, the study's faithful K, or `backward: implicit` (DKEF's "
        "linear map solved directly). Ratios: over the explicit shallow network of the same family.",
        "Activation memory: the tensors the step's autograd graph saves (`loss_step_bytes`), parameters excluded; "
        "solver working memory (Anderson's history, the linearised map inside an adjoint solve) is not in it for "
        "any row, and the CUDA peak column (on a GPU) includes it.",
    ]
    return table
