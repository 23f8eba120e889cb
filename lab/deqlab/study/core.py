"""The study's machinery, the same for every family: what a family declares (:class:`Family`), one unit of work
(train one variant at one seed with the protocol's budget, then evaluate it: :func:`run_unit`), and the
per-variant mean and standard error over seeds (:func:`summarise`).

A unit is recorded as ``<out>/<family>/<group>/<variant>_s<seed>.json`` with the family, group (data set),
variant, seed, the device and the settings (the protocol's version and SHA-256, budget, iterations, validations,
evaluation sizes, fit options, extra arguments); a unit already recorded with the same settings is read back and
not run again (:func:`deqlab.units.recorded`). Image families also leave the unit's sample grid beside it
(``<variant>_s<seed>.png``). A unit of an earlier design that a new one replaces is kept, under
``<out>/<family>/<group>/v<version>/`` (:func:`keep_earlier`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deqscore.configfiles import composed_text
from deqscore.families import ROOT, declarations
from deqscore.lightning.callbacks import read_metrics_csv

from ..entries import Metric
from ..measure import changed_code, committed_as
from ..units import mean_stderr, recorded, repo_relative
from .protocol import Protocol, ProtocolError

# files that only write the results page: a change to them leaves every recorded unit as it was
REPORT_ONLY = tuple(f"lab/deqlab/study/{name}.py" for name in ("report", "tables", "judging", "verdict", "figures"))
CURVE_POINTS = 60  # points kept of each training curve in a unit file
LAUNCH_FILE = "study_launch.json"  # in a unit's run directory: what it was launched with (a stopped one resumes)


@dataclass(frozen=True)
class Variant:
    """One network of a family: its config (relative to the repository root) and overrides."""

    config: str
    # "shallow", "deep", "deq", "deq_faithful" (the DEQ with an exact enough training derivative), "deq_reference",
    # "classical" (another model class) or "untrained"
    role: str
    overrides: tuple[str, ...] = ()
    steps_per_iteration: int = 1  # optimiser steps per training iteration (the implicit VAE: 2 score + 1)
    trained: bool = True  # False: the network at initialisation, through the same evaluation


# (run directory, checkpoint to evaluate, variant, seed, evaluation settings) -> metrics; may leave samples.png
Evaluate = Callable[[Path, Path, Variant, int, dict], dict]


@dataclass(frozen=True)
class Family:
    """What a family brings to the study: its code. ``iterations`` is the training length at budget 1; every
    variant gets the same iterations, fit options and evaluation, which the protocol fixes
    (:mod:`.protocol`). The protocol names the metric the claim is judged on among ``metrics`` (:meth:`judged`).
    ``groups`` are the data sets, each with its fit overrides."""

    name: str
    title: str
    setting: str  # the page's description of data, budget and evaluation
    iterations: int
    variants: dict[str, Variant]
    metrics: tuple[Metric, ...]
    evaluate: Evaluate
    groups: dict[str, tuple[str, ...]] = field(default_factory=lambda: {"mnist": ()})
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # the accepted values of a text evaluation key
    context: str = ""  # a published figure for orientation, and why the study's numbers are not comparable to it

    def iterations_at(self, budget: float) -> int:
        return max(1, round(self.iterations * budget))

    def judged(self, design: Protocol) -> Metric:
        """The metric the claim is judged on: the ``metric`` of the family's entry in ``design`` (a protocol)."""
        return self._metric(design.family(self.name)["metric"])

    def control(self, design: Protocol) -> Metric:
        """The metric the untrained network is a control of: the entry's ``control_metric``, else the judged one."""
        return self._metric(design.family(self.name).get("control_metric", design.family(self.name)["metric"]))

    def _metric(self, key: str) -> Metric:
        try:
            return next(m for m in self.metrics if m.key == key)
        except StopIteration:
            raise ValueError(f"the {self.name} study has no metric {key!r}; it has "
                             f"{', '.join(m.key for m in self.metrics)}") from None


def unit_path(out: Path, family: str, group: str, variant: str, seed: int) -> Path:
    """Where the unit of (``family``, ``group``, ``variant``, ``seed``) is recorded."""
    return out / family / group / f"{variant}_s{seed}.json"


def rerun_path(unit_file: Path) -> Path:
    """Where a rerun of the unit recorded at ``unit_file`` is recorded (beside it, never counted as a unit)."""
    return unit_file.parent / "reruns" / unit_file.name


def keep_earlier(path: Path, group_dir: Path, protocol: Protocol) -> None:
    """Move the unit file at ``path`` under ``group_dir`` (with its sample grid, and a unit's rerun under
    ``reruns/``) to ``group_dir/v<version>/``, the version it was recorded under, where ``protocol`` does not govern
    it: a unit of an earlier design is judged on the page beside the newer design's (:func:`.report.load_units`),
    so the unit that takes its place never overwrites it. A unit of the same design (run again for a changed config
    or code) is replaced."""
    moves = []
    for unit_file in (path, *([rerun_path(path)] if path.parent == group_dir else [])):
        if not unit_file.exists() or protocol.governs(unit := json.loads(unit_file.read_text())):
            continue
        version = (unit["settings"].get("protocol") or {}).get("version")
        target = group_dir / f"v{version}" / unit_file.relative_to(group_dir)
        moves += [(p, target.with_suffix(p.suffix)) for p in (unit_file, unit_file.with_suffix(".png")) if p.exists()]
    for source, kept in moves:
        if kept.exists():  # only a copy made by hand gets here; both files stay as they are
            raise ProtocolError(f"{kept}: already holds a unit of that version, so {source} cannot be kept there; "
                                "move one of the two away")
    for source, kept in moves:
        kept.parent.mkdir(parents=True, exist_ok=True)
        source.rename(kept)


def recorded_files(folder: Path, kind: str = "") -> list[Path]:
    """The unit files (``kind=""``) or tuning runs (``kind="tuning"``) of a family's ``folder``: each group's, and
    those of the earlier designs kept beside them under ``<group>/v<version>/`` (:func:`keep_earlier`)."""
    sub = f"{kind}/" if kind else ""
    return sorted([*folder.glob(f"*/{sub}*.json"), *folder.glob(f"*/v[0-9]*/{sub}*.json")])


@dataclass(frozen=True)
class UnitSettings:
    """What every unit of one study call shares: the protocol it runs under (recorded as its version and
    SHA-256), the budget (a fraction of the family's iterations), validations per run, the evaluation, the fit
    options and extra arguments. A unit recorded with other settings is run again."""

    protocol: Protocol
    budget: float
    validations: int
    evaluation: dict[str, Any]
    fit: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    tune: bool = True  # each arm's learning rate by the protocol's rule (False: the configs' rates, a trial)

    @property
    def learning_rate(self) -> str:
        """How the arms' learning rates were set: ``tuned`` by the protocol's rule, or the ``config``'s."""
        return "tuned" if self.tune and "learning_rate" in self.protocol.text else "config"

    def recorded_as(self, family: Family) -> dict[str, Any]:
        return {"protocol": self.protocol.stamp, "budget": self.budget,
                "iterations": family.iterations_at(self.budget), "validations": self.validations,
                "evaluation": self.evaluation, "fit": list(self.fit), "extra": list(self.extra),
                **({"learning_rate": self.learning_rate} if "learning_rate" in self.protocol.text else {})}

    def hold_for(self, unit: dict[str, Any], family: Family) -> bool:
        """Whether the recorded ``unit`` ran with these settings, under this protocol or an earlier version that
        governs it alike (:meth:`.protocol.Protocol.governs`)."""
        mine = json.loads(json.dumps(self.recorded_as(family)))  # as it reads back (tuples become lists)
        return self.protocol.governs(unit) and without_protocol(unit["settings"]) == without_protocol(mine)


# (family, groups, the seeds of each variant to run, the settings its units share): what one study call runs
Plan = list[tuple[Family, list[str], dict[str, list[int]], UnitSettings]]


def without_protocol(settings: dict[str, Any]) -> dict[str, Any]:
    """A unit's settings less the protocol stamp: what units of one table share, whichever version they ran
    under (the protocol has vouched for each)."""
    return {key: value for key, value in settings.items() if key != "protocol"}


def import_run_code() -> None:
    """Import now what a unit imports when it runs (the command-line fit and sampling), so that a study of hours runs
    the code of its start throughout: the checkout edited meanwhile cannot give one process two versions of it."""
    from deqscore.cli import sample, train  # noqa: F401


def fit_arguments(family: Family, group: str, name: str, seed: int, settings: UnitSettings,
                  learning_rate: tuple[str, float] | None = None) -> list[str]:
    """The arguments of a unit's ``train.py fit`` beside its config: seed, budget, validations, the protocol's fit
    options, the data set's, the variant's overrides, the learning rate chosen for its arm (``(option, rate)``),
    then ``--extra``."""
    variant = family.variants[name]
    iterations = family.iterations_at(settings.budget) if variant.trained else 0
    interval = max(1, iterations // settings.validations)
    rate = [] if learning_rate is None else [f"{learning_rate[0]}={learning_rate[1]!r}"]
    return [f"--seed_everything={seed}", f"--trainer.max_steps={iterations * variant.steps_per_iteration}",
            "--trainer.max_epochs=-1", f"--trainer.val_check_interval={interval}",
            "--trainer.check_val_every_n_epoch=null", "--trainer.enable_progress_bar=false",
            *settings.fit, *family.groups[group], *variant.overrides, *rate, *settings.extra]


def fit_record(family: Family, name: str, arguments: list[str]) -> dict[str, Any]:
    """What governs a unit's fit beside the settings: the SHA-256 of its composed config (the repository's path
    written as ``<repo>``, so that clones agree) and its arguments."""
    text = repo_relative(composed_text(ROOT / family.variants[name].config))
    return {"config_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "arguments": [repo_relative(a) for a in arguments]}


def outside_family(family: str, path: str, families: list[str]) -> bool:
    """Whether a changed file cannot change ``family``'s units: another family's file (a path part or file name
    starting with its name) or a file that only writes the page (:data:`REPORT_ONLY`)."""
    if path in REPORT_ONLY:
        return True
    parts = [Path(path).stem, *Path(path).parts[:-1]]
    others = [f for f in families if f != family]
    return any(part.startswith(other) for part in parts for other in others) and \
        not any(part.startswith(family) for part in parts)


def holding_commit(code: dict) -> str | None:
    """The commit whose code a run ran: its commit, or where it had uncommitted changes, the later commit that holds
    exactly those (:func:`~deqlab.measure.committed_as`); None where none does."""
    if not code["uncommitted_changes"]:
        return code["commit"]
    return committed_as(code["commit"], code["changes_sha256"]) if code.get("changes_sha256") else None


def code_alike(recorded: dict | None, running: dict | None, family: str, families: list[str]) -> bool:
    """Whether a unit recorded with code ``recorded`` holds for the ``running`` code: the same commit with the same
    uncommitted changes (by hash), or commits holding both codes (:func:`holding_commit`) whose difference touches
    none of the family's code."""
    if recorded is None or running is None:
        return False
    if recorded["commit"] == running["commit"]:
        return recorded.get("changes_sha256") == running.get("changes_sha256")
    commits = holding_commit(recorded), holding_commit(running)
    if None in commits:
        return False
    changed = [] if commits[0] == commits[1] else changed_code(*commits)
    return changed is not None and all(outside_family(family, f, families) for f in changed)


def run_unit(family: Family, group: str, name: str, seed: int, settings: UnitSettings, runs_root: Path, out: Path,
             facts: dict[str, Any], learning_rate: tuple[str, float] | None = None, kind: str = "unit") -> dict:
    """The unit of (``group``, ``name``, ``seed``): read back from its file when nothing that governs it differs
    (its settings under this protocol or an earlier version that governs it alike, its composed config, its
    arguments and its code: :func:`code_alike`), else trained, evaluated and recorded with ``facts`` (device,
    threads, torch, code) and its start and end. ``kind``: ``unit``; ``rerun``, the same unit recorded again under
    ``reruns/`` (the run-to-run spread); ``tuning``, a learning-rate tuning run under ``tuning/`` (trained, not
    evaluated)."""
    arguments = fit_arguments(family, group, name, seed, settings, learning_rate)
    governing = fit_record(family, name, arguments)
    unit_file = unit_path(out, family.name, group, name, seed)
    group_dir = unit_file.parent
    tuning = f"{name}_lr{learning_rate[1]!r}_s{seed}.json" if learning_rate else unit_file.name
    path = {"unit": unit_file, "rerun": rerun_path(unit_file), "tuning": group_dir / "tuning" / tuning}[kind]
    names = list(declarations())

    def compute() -> dict:
        keep_earlier(path, group_dir, settings.protocol)
        run_dir = runs_root / family.name / group / path.relative_to(group_dir).with_suffix("")
        launch = {"settings": settings.recorded_as(family), "fit": governing, "code": facts.get("code")}
        result = train_and_evaluate(family, name, seed, settings, run_dir, arguments, evaluate=kind != "tuning",
                                    launch=launch)
        grid = run_dir / "samples" / "samples.png"
        if grid.exists() and kind == "unit":
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(grid, path.with_suffix(".png"))
        return result

    def still_holds(saved: dict) -> bool:
        return settings.hold_for(saved, family) and saved.get("fit") == governing and \
            code_alike(saved.get("code"), facts.get("code"), family.name, names)

    recorded(path, settings.recorded_as(family), compute, still_holds, timed=True,
             family=family.name, group=group, variant=name, seed=seed, fit=governing, **facts)
    return json.loads(path.read_text())  # the unit as recorded: facts, settings and value


def resumable(run_dir: Path, launch: dict | None) -> tuple[Path, int] | None:
    """The checkpoint a stopped run of this very unit continues from (:func:`~deqscore.lightning.runs.
    resume_checkpoint`), and its step: its run directory records the same ``launch`` (settings, composed config and
    arguments, code) and holds a checkpoint; None otherwise."""
    import torch

    from deqscore.lightning.runs import resume_checkpoint

    record = run_dir / LAUNCH_FILE
    if launch is None or not record.is_file() or json.loads(record.read_text()) != json.loads(json.dumps(launch)):
        return None
    found = resume_checkpoint(run_dir)
    if found is None:
        return None
    return found, torch.load(found, map_location="cpu", weights_only=False)["global_step"]


def train_and_evaluate(family: Family, name: str, seed: int, settings: UnitSettings, run_dir: Path,
                       arguments: list[str], evaluate: bool = True, launch: dict | None = None) -> dict:
    """``train.py fit`` of one variant with ``arguments`` (none of its iterations for an untrained variant), then,
    with ``evaluate``, the family's evaluation of its final weights: the run facts, the curves and the metrics. A
    run of the same ``launch`` that was stopped (preempted, killed) continues from its checkpoint, which gives what
    an uninterrupted run gives; any other run found in ``run_dir`` is moved aside."""
    from deqscore.cli.train import main as train
    from deqscore.lightning.runs import RunLock, move_aside

    warnings.filterwarnings("ignore", "LightningCLI's args parameter is intended")  # CLI calls from Python
    variant = family.variants[name]
    # a unit another process is running is refused before its directory is read or moved (the fit takes the
    # lock again for itself)
    with RunLock(run_dir, remedy="run the study again once it has finished"):
        resume, resumed_steps = resumable(run_dir, launch) or (None, 0)
        if resume is not None:
            print(f"continuing the stopped run {run_dir} from {resume.name}")
        elif run_dir.exists():  # left by another launch, or stopped before its first checkpoint: kept aside
            print(f"moved the earlier run {run_dir} aside to {move_aside(run_dir)}")
        if resume is None and launch is not None:
            run_dir.mkdir(parents=True)
            (run_dir / LAUNCH_FILE).write_text(json.dumps(launch))
    iterations = family.iterations_at(settings.budget) if variant.trained else 0
    start = time.perf_counter()
    fit = train(["fit", f"--config={ROOT / variant.config}", f"--run_name={run_dir.name}",
                 f"--runs_root={run_dir.parent}", *arguments, *([f"--ckpt_path={resume}"] if resume else [])])
    fit_seconds = time.perf_counter() - start
    ran = iterations - resumed_steps / variant.steps_per_iteration  # the iterations this call trained
    if fit.trainer.global_step != iterations * variant.steps_per_iteration:  # e.g. --extra changed score_updates
        raise RuntimeError(f"{family.name} {name}: {fit.trainer.global_step} optimiser steps where the budget is "
                           f"{iterations} iterations of {variant.steps_per_iteration}; the variant's "
                           "steps_per_iteration does not match its module")
    logged = run_dir / "metrics.csv"  # an untrained run logs nothing
    series = read_metrics_csv(logged) if logged.exists() else {}
    facts = {"config": variant.config, "arguments": arguments, "iterations": iterations,
             "optimiser_steps": fit.trainer.global_step, **run_facts(series),
             "seconds_per_iteration": fit_seconds / ran if ran else None, "curves": curves(series),
             **({"resumed_at_step": resumed_steps} if resume is not None else {})}
    if not evaluate:  # a tuning run: its validation figures
        return facts | {"validation": {k: v for k, v in series.items() if k.startswith("val/")}}
    checkpoint = run_dir / "checkpoints" / "final.ckpt"  # a family's closing stage (DKEF) ends in final.ckpt
    if not checkpoint.exists():
        checkpoint = run_dir / "checkpoints" / "study_last.ckpt"  # the weights at the end of training
        fit.trainer.save_checkpoint(checkpoint)
    metrics = family.evaluate(run_dir, checkpoint, variant, seed, settings.evaluation)
    trust = metrics.pop("trust", None)
    if trust is not None:  # the share of training's logged solves that stopped at the layer's cap
        nstep = [v for _, v in series.get("train/deq/nstep", [])]
        trust["capped_solves_training"] = sum(v >= trust["max_iter"] for v in nstep) / len(nstep) if nstep else None
    return facts | {"evaluated": checkpoint.name, "metrics": metrics, "trust": trust}


def last_logged(series: dict[str, list[tuple[int, float]]], key: str) -> float | None:
    """The value ``key`` was last logged at (``series``: key -> (step, value) pairs); None where it never was."""
    return series[key][-1][1] if series.get(key) else None


def run_facts(series: dict[str, list[tuple[int, float]]]) -> dict[str, Any]:
    """Parameters, activation memory of one training step, and the DEQ solver's statistics over training (mean
    forward iterations, last relative residual, fraction of IFT backward solves that missed their tolerance);
    None where the run logged none (an explicit network has no solver)."""
    last = functools.partial(last_logged, series)
    nstep = [v for _, v in series.get("train/deq/nstep", [])]
    parameters = last("run/parameters")
    return {"parameters": None if parameters is None else int(parameters),
            "activation_memory_mb": last("run/activation_memory_mb"),
            "solver_iterations": sum(nstep) / len(nstep) if nstep else None,
            "solver_rel_residual": last("train/deq/rel_residual"),
            "ift_backward_failures": last("train/deq/ift_backward_failures")}


def curves(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """The training and validation loss against the step, the training one thinned to :data:`CURVE_POINTS`."""
    out = {}
    for key in ("train/loss", "val/loss"):
        points = series.get(key, [])
        stride = max(1, len(points) // CURVE_POINTS)
        out[key] = points[::stride]
    return out


def seed_curve(runs: list[dict], key: str) -> dict[int, tuple[float, float | None]]:
    """The curve ``key`` of trained runs (unit values) at the steps all of them logged: step -> (mean, standard
    error) over the runs, in step order."""
    series = [dict(r["curves"].get(key, [])) for r in runs if r["iterations"]]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    return {t: mean_stderr([s[t] for s in series]) for t in steps}


def summarise(units: list[dict], keys: list[str]) -> list[dict]:
    """Per (group, variant), in the order first met: the seeds and the mean and standard error over them of each
    of ``keys`` (looked up in the unit's metrics, then its run facts); a key a unit lacks is left out."""
    out = []
    for group, name in dict.fromkeys((u["group"], u["variant"]) for u in units):
        runs = [u for u in units if (u["group"], u["variant"]) == (group, name)]
        summary: dict[str, Any] = {"group": group, "variant": name, "seeds": [u["seed"] for u in runs]}
        for key in keys:
            values = [value_of(u, key) for u in runs]
            values = [v for v in values if v is not None]
            if values:
                mean, stderr = mean_stderr(values)
                summary[key] = {"mean": mean, "stderr": stderr, "n": len(values)}
        out.append(summary)
    return out


def value_of(unit: dict, key: str) -> Any:
    value = unit["value"]
    return value["metrics"].get(key, value.get(key))
