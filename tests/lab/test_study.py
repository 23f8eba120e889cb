"""The reproduction study end to end at a tiny budget, per family: every unit is recorded with what its run logged
and scored, a recorded unit is not run again, and the page is written from the unit files alone."""

import functools
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from deqlab import main
from deqlab.entries import STUDIES
from deqlab.measure import code_version
from deqlab.study import core, judging, protocol, tables
from deqlab.study import report as report_module
from deqlab.study.families import families
from deqlab.study.report import fmt
from deqscore.lightning.callbacks import read_metrics_csv
from tests.families import fixture_file

PROTOCOL = protocol.load()
V = f"v{PROTOCOL.version}"  # the newest protocol, as the page names it
FAMILIES = families()

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=2"]
def runnable(name: str) -> list[str]:
    """The protocol's variants of a family that this checkout can train (deq_implicit needs the DEQ's implicit
    backward)."""
    from deqscore.deq.layer import BACKWARD_MODES

    return [v for v in FAMILIES[name].variants if PROTOCOL.seeds(name, v)
            and (v != "deq_implicit" or "implicit" in BACKWARD_MODES)]


def run_study(tmp_path, name: str, *more: str) -> dict:
    """A tiny-budget study of the family's runnable variants at the configs' learning rates (tuning has its own
    test)."""
    family = FAMILIES[name]
    options, fit = fixture_file(name).STUDY_TINY
    return main(["study", "--family", name, "--budget", str(2 / family.iterations), "--runs-root",
                 str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--config-rates",
                 "--variants", ",".join(runnable(name)), *options, *more, "--extra", *QUIET, *fit])


def dkef_explicit_s0(root: Path, *fit_options: str) -> dict:
    """A tiny study of DKEF's shallow network, seed 0, in ``root`` (runs/ and out/), at the config's rate."""
    options, fit = fixture_file("dkef").STUDY_TINY
    return main(["study", "--family", "dkef", "--budget", str(2 / FAMILIES["dkef"].iterations), "--runs-root",
                 str(root / "runs"), "--out", str(root / "out"), "--config-rates", "--variants", "explicit",
                 "--seeds", "0", *options[2:], "--extra", *QUIET, *fit, *fit_options])


# NCSN's and EDM's runs (a minute each: sampling and Inception features) add nothing the fast suite lacks: the study
# machinery is covered by the other families, their sampling and FID by tests/test_sampling.py, their evaluations'
# options below; DKEF's (45 s) runs in the fast suite through the parallel-processes test
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("ncsn", "edm", "dkef") else n
                                  for n in FAMILIES])
def test_a_family_study_records_what_its_runs_logged_skips_recorded_units_and_writes_the_page(
        tmp_path, monkeypatch, name):
    family = FAMILIES[name]
    units = run_study(tmp_path, name)[name]
    seeds = [int(s) for s in fixture_file(name).STUDY_TINY[0][1].split(",")]
    group = next(iter(family.groups)) if name != "dkef" else "redwine"
    variants = runnable(name)  # the protocol's
    assert [(u["group"], u["variant"], u["seed"]) for u in units] == [(group, v, s) for s in seeds for v in variants]
    for unit in units:
        variant = family.variants[unit["variant"]]
        path = core.unit_path(tmp_path / "out", name, group, unit["variant"], unit["seed"])
        assert set(json.loads(path.read_text())) == {"family", "group", "variant", "seed", "device", "cpu_instructions",
                                                     "code", "threads", "torch", "started", "ended", "fit",
                                                     "settings", "value"}
        assert unit["code"] == code_version() and len(unit["code"]["commit"]) == 40  # the checkout's commit
        assert unit["threads"] == PROTOCOL.text["threads"] and unit["torch"] == torch.__version__
        assert unit["started"] <= unit["ended"] and unit["started"].endswith("+00:00")  # UTC, ISO 8601
        assert unit["fit"]["arguments"] == [a.replace(str(core.ROOT), "<repo>") for a in unit["value"]["arguments"]]
        assert len(unit["fit"]["config_sha256"]) == 64
        assert unit["family"] == name and unit["device"].startswith("cpu") and unit["settings"]["iterations"] == 2
        assert unit["cpu_instructions"] == torch.backends.cpu.get_cpu_capability()
        assert unit["settings"]["budget"] == 2 / family.iterations
        assert unit["settings"]["protocol"] == PROTOCOL.stamp and unit["settings"]["fit"] == \
            PROTOCOL.family(name)["fit"]  # the protocol's shared options reach every fit
        assert unit["settings"]["validations"] == PROTOCOL.validations
        value, run = unit["value"], tmp_path / "runs" / name / group / f"{unit['variant']}_s{unit['seed']}"
        series = read_metrics_csv(run / "metrics.csv") if variant.trained else {}  # untrained: nothing logged
        # trained for the budget (the implicit VAE: 3 optimiser steps per iteration); untrained: not at all
        steps = 2 * variant.steps_per_iteration if variant.trained else 0
        assert value["optimiser_steps"] == steps and value["iterations"] == (2 if variant.trained else 0)
        if variant.trained:
            assert value["parameters"] == series["run/parameters"][-1][1]
            assert value["activation_memory_mb"] == series["run/activation_memory_mb"][-1][1]
        # a metric the run's test stage logged is reported as logged (the image families' KID from sample.py, below)
        logged = [m.key for m in STUDIES[name].metrics if f"test/{m.key}" in series]
        assert bool(logged) == variant.trained
        for key in logged:
            assert value["metrics"][key] == pytest.approx(series[f"test/{key}"][-1][1])
        if name in ("ncsn", "edm"):  # the unit holds the scores of the samples sample.py drew
            report = json.loads((run / "samples" / "fid.json").read_text())
            scores = ("kid", "kid_se", "fid")
            assert [value["metrics"][k] for k in scores] == [report[k] for k in scores]
            assert report["num_samples"] == 4 and "(6 images)" in report["reference"]
        if name == "vae":  # the ELBO only for the Gaussian encoder: the implicit one has none
            assert ("elbo" in value["metrics"]) == (variant.role == "classical")
        assert (value["solver_iterations"] is not None) == ("deq" in variant.role)  # explicit nets have no solver
        # measured through train.py test, the untrained control's too (the DEQ at initialisation)
        trusted = variant.role.startswith("deq") or (variant.role == "untrained" and name in ("ncsn", "edm"))
        assert (value["trust"] is not None) == trusted
        if trusted:
            assert 0 < value["trust"]["contraction"] < 1 and value["trust"]["gradient_rel_error"] >= 0
        if name in ("ncsn", "edm"):  # a DEQ's sampler cost, cold and warm (the untrained control is a DEQ)
            cost = value["metrics"].get("sampling_cost")
            assert (cost is not None) == trusted
            for start in ("cold", "warm") if cost else ():
                assert cost[f"iterations_per_evaluation_{start}"] > 0
                assert cost[f"iterations_per_sample_{start}"] == pytest.approx(
                    cost["evaluations_per_sample"] * cost[f"iterations_per_evaluation_{start}"])
        assert path.with_suffix(".png").exists() == (name != "dkef")  # the sample grid of an image family
    # a second call reads every unit back: nothing is trained again
    monkeypatch.setattr(core, "train_and_evaluate", lambda *a, **k: pytest.fail("a recorded unit was run again"))
    assert run_study(tmp_path, name)[name] == units
    # the page, from the unit files alone
    page = tmp_path / "results.md"
    main(["study", "--report", "--out", str(tmp_path / "out"), "--page", str(page)])
    text = page.read_text()
    metric = family.judged(PROTOCOL).key
    for unit in units[: len(family.variants)]:
        values = [u["value"]["metrics"][metric] for u in units if u["variant"] == unit["variant"]]
        mean = sum(values) / len(values)
        spread = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1) / len(values)
        cell = fmt(mean) + ("" if len(values) == 1 else f" ± {fmt(math.sqrt(spread))}")
        role = family.variants[unit["variant"]].role
        expected = PROTOCOL.seeds(name, unit["variant"])
        missing = ", ".join(str(s) for s in expected if s not in seeds)  # the tiny study runs fewer seeds
        assert f"| {group} | {unit['variant']} | {role} | {len(values)} of {len(expected)}; **missing** {missing} " \
               f"| {cell} |" in text
    for figure in (f"v{PROTOCOL.version}_curves_{group}.png", f"v{PROTOCOL.version}_quality_vs_memory.png"):
        assert (tmp_path / "out" / name / figure).exists() and f"{name}/{figure})" in text
    assert f"* **protocol**: v{PROTOCOL.version}, **off-protocol settings**" in text  # a tiny budget is a trial
    for unit in units:  # every seed's grid
        grid = f"{name}/{group}/{unit['variant']}_s{unit['seed']}.png)"
        assert (grid in text) == (name != "dkef")


def write_unit(out, family: str, group: str, variant: str, seed: int, metrics: dict, trust: dict | None = None,
               curve: list | None = None, device: str = "cpu: test") -> None:
    entry = PROTOCOL.family(family)
    settings = {"protocol": PROTOCOL.stamp, "budget": entry["budget"], "iterations": 4, "validations": 10,
                "evaluation": entry["evaluation"], "fit": entry["fit"], "extra": []}
    unit = {"family": family, "group": group, "variant": variant, "seed": seed, "device": device,
            "settings": settings,
            "value": {"iterations": 4, "optimiser_steps": 4, "curves": {"val/loss": curve or []},
                      "activation_memory_mb": 10.0 if "deq" in variant else 20.0, "parameters": 5,
                      "metrics": metrics, "trust": trust}}
    path = core.unit_path(out, family, group, variant, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(unit))


def report(tmp_path) -> str:
    page = tmp_path / "results.md"
    main(["study", "--report", "--out", str(tmp_path), "--page", str(page)])
    return page.read_text()


def test_the_verdicts_at_the_protocols_margin(tmp_path):
    """DKEF (higher is better, margin 0.1 nats): a DEQ better by 0.2 with small noise holds, before and after
    Holm; one 0.5 worse fails; one 0.03 worse with noise that v1's rule passed ('worse by less than one standard
    error') is inconclusive, with its power worded as a chance, and interim (3 of 5 seeds); a single seed is not
    judged."""
    def write(group, variant, values, **kw):
        for seed, v in enumerate(values):
            write_unit(tmp_path, "dkef", group, variant, seed, {"log_likelihood": v, "log_z_ess": 500.0}, **kw)

    write("redwine", "explicit", [-1.0, -1.02, -0.98, -1.01, -0.99])
    write("redwine", "deq", [-0.8, -0.82, -0.78, -0.81, -0.79])
    write("whitewine", "explicit", [-1.0, -1.02, -0.98, -1.01, -0.99])
    write("whitewine", "deq", [-1.5, -1.52, -1.48, -1.51, -1.49])
    write("parkinsons", "explicit", [-1.0, -1.3, -0.7])
    write("parkinsons", "deq", [-1.03, -1.33, -0.73])
    write("parkinsons", "explicit_deep", [-1.2])
    text = report(tmp_path)
    m = len(judging.defined_comparisons(FAMILIES["dkef"], PROTOCOL))
    assert m == 18  # 3 data sets x 3 DEQ variants x 2 explicit networks, fixed by the protocol
    assert f"| DKEF on UCI data | {V} | redwine | deq vs explicit (shallow) | 5 of 5 / 5 of 5 | +0.2 ± 0.01 |" in text
    assert f"| 0.100 | **holds** | **holds** (m = {m}) |" in text
    assert f"| 0.100 | **fails** | **fails** (m = {m}) |" in text
    assert "| whitewine | deq vs explicit (shallow) | 5 of 5 / 5 of 5 | -0.5 ± 0.01 |" in text
    unsure = [line for line in text.splitlines() if line.startswith(f"| DKEF on UCI data | {V} | parkinsons | deq vs "
                                                                     "explicit (shallow)")]
    assert len(unsure) == 1 and "| 3 of 5 / 3 of 5 |" in unsure[0]
    assert "interim: **inconclusive**; " in unsure[0] and "chance to hold with these seeds if the two were equal" \
        in unsure[0] and f"interim: **inconclusive** (m = {m})" in unsure[0]
    assert "| parkinsons | deq vs explicit_deep (deep) | 3 of 5 / 1 of 3 | – |" in text and \
        "fewer than two seeds a side" in text
    assert "| parkinsons | deq | deq | 3 of 5; **missing** 3, 4 |" in text  # a missing seed shown as missing
    # an arm without a unit keeps its row: all its seeds missing (here the trust-only reference DEQ)
    assert "| whitewine | deq_reference | deq_reference | 0 of 3; **missing** 0, 1, 2 | – | – | – | no curve | – |" \
        in text
    assert "| 0.50 |" in text  # the DEQ's memory against the shallow network's
    assert f"Holm's correction over the {m} comparisons this design defines" in text
    # the 14 defined comparisons without units on both sides are named, not silently left out
    not_run = next(line for line in text.splitlines() if line.startswith("**Not run**"))
    assert not_run.startswith(f"**Not run** (14 of the {m} comparisons")
    assert "whitewine deq vs explicit_deep;" in not_run
    assert "parkinsons deq vs explicit_deep" not in not_run and "redwine deq vs explicit;" not in not_run
    (tmp_path / "dkef").rename(tmp_path / "aside")  # one unit, no comparison yet: m is still the protocol's
    write_unit(tmp_path, "dkef", "redwine", "explicit", 0, {"log_likelihood": -1.0, "log_z_ess": 500.0})
    text = report(tmp_path)
    assert f"Holm's correction over the {m} comparisons this design defines" in text
    assert f"| DKEF on UCI data | {V} | – | no comparison yet |" in text  # the summary says so


def test_a_comparison_whose_arms_ran_on_different_devices_is_marked(tmp_path):
    """NCSN's shallow network on a GPU, the DEQ's seeds partly on a CPU: both verdicts name the two devices (their
    arithmetic differs); with every unit on the GPU, no mark."""
    gpu = "cuda: NVIDIA H200"
    for seed in range(5):
        write_unit(tmp_path, "ncsn", "mnist", "explicit", seed, {"dsm_every_level": 170.0 + seed}, device=gpu)
        write_unit(tmp_path, "ncsn", "mnist", "deq", seed, {"dsm_every_level": 170.5 + seed},
                   device="cpu: test" if seed == 4 else gpu)
    row = [line for line in report(tmp_path).splitlines() if "| deq vs explicit (shallow) |" in line][-1]
    assert row.count(f"across devices (cpu: test; {gpu}): **") == 2, row
    write_unit(tmp_path, "ncsn", "mnist", "deq", 4, {"dsm_every_level": 174.5}, device=gpu)
    row = [line for line in report(tmp_path).splitlines() if "| deq vs explicit (shallow) |" in line][-1]
    assert "across devices" not in row and "**" in row


def test_a_run_of_uncommitted_code_names_the_commit_that_holds_it(tmp_path, monkeypatch):
    """A run records commit A 'with uncommitted changes' (their SHA-256); later commits are an unrelated one and
    then exactly those changes: the page names the latter. Other changes, or none committed, name none."""
    import subprocess

    from deqlab import measure

    repo = tmp_path / "repo"
    (repo / "deqscore").mkdir(parents=True)

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout

    monkeypatch.setattr(measure, "_git", git)
    measure.committed_as.cache_clear()
    git("init", "-q")
    (repo / "deqscore" / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "A")
    (repo / "deqscore" / "a.py").write_text("x = 2\n")
    ran = measure.code_version()
    assert ran["uncommitted_changes"]
    label = tables.code_label(ran)
    assert label == f"`{ran['commit'][:10]}`+"  # nothing holds the changes yet
    (repo / "notes.md").write_text("unrelated\n")
    git("add", "notes.md")
    git("commit", "-qm", "B")
    git("add", "-A")
    git("commit", "-qm", "C")
    holder = git("rev-parse", "HEAD").strip()
    measure.committed_as.cache_clear()
    assert tables.code_label(ran) == f"`{ran['commit'][:10]}`+ (= `{holder[:10]}`)"
    assert measure.committed_as(ran["commit"], "0" * 64) is None
    measure.committed_as.cache_clear()


def test_a_seed_outside_the_protocol_is_refused_by_name(tmp_path, capsys):
    """An extra seed file (seed 7 of a 5-seed arm) moves a verdict as surely as a deleted one: the report names it
    and writes nothing."""
    for seed in range(5):
        write_unit(tmp_path, "nice", "mnist", "explicit", seed, {"bits_per_dim": 5.0})
    report(tmp_path)
    write_unit(tmp_path, "nice", "mnist", "explicit", 7, {"bits_per_dim": 4.0})
    page = tmp_path / "results.md"
    page.unlink()
    with pytest.raises(SystemExit):
        report(tmp_path)
    err = capsys.readouterr().err
    assert f"explicit_s7.json: seed 7 of nice/mnist/explicit is not a seed of protocol {V} (seeds 0 .. 4" in err
    assert not page.exists()


def test_the_log_z_rule_excludes_a_unit_and_its_error_enters_the_test(tmp_path):
    """A DKEF unit whose log Z rests on fewer than 100 effective draws is excluded from its arm (and named); each
    unit's log Z standard error widens the comparison's: here it turns a 'holds' into 'inconclusive'."""
    def write(variant, values, ess=(500.0,) * 5, stderr=0.0):
        for seed, v in enumerate(values):
            write_unit(tmp_path, "dkef", "redwine", variant, seed,
                       {"log_likelihood": v, "log_z_ess": ess[seed], "log_z_stderr": stderr})

    explicit = [-1.0, -1.02, -0.98, -1.01, -0.99]
    write("explicit", explicit)
    write("deq", [-0.95, -0.97, -0.93, -0.96, 3.0], ess=(500.0, 500.0, 500.0, 500.0, 20.0))
    text = report(tmp_path)
    assert "| redwine | deq | deq | 4 of 5; **excluded** 4 (log Z ESS 20 < 100) |" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| DKEF on UCI data | {V} | redwine | deq vs"))
    assert "| 4 of 5 / 5 of 5 | +0.0475 ± 0.011 |" in row and "| **holds** |" in row  # seed 4 (+3.0) left out
    assert "| **excluded**: log Z ESS 20 < 100 |" in text  # and named in the per-run table
    write_unit(tmp_path, "dkef", "redwine", "deq_faithful", 0, {"log_likelihood": 9.0, "log_z_ess": 20.0})
    # an arm whose every unit is excluded keeps its row, without a mean
    assert ("| redwine | deq_faithful | deq_faithful | 0 of 5; **missing** 1, 2, 3, 4; **excluded** 0 (log Z ESS 20 "
            "< 100) | – |") in report(tmp_path)
    write("explicit", explicit, stderr=0.2)
    write("deq", [-0.95, -0.97, -0.93, -0.96, -0.94], stderr=0.2)
    row = next(line for line in report(tmp_path).splitlines()
               if line.startswith(f"| DKEF on UCI data | {V} | redwine | deq vs"))
    se = math.sqrt(2 * 0.00025 / 5 + 2 * 5 * 0.2**2 / 5**2)  # the seeds' spread, then sum(se_Z^2) / n^2 a side
    assert f"+0.05 ± {se:.2g} |" in row and "**inconclusive**" in row


def test_curve_labels_per_arm_and_trust_figures_reach_the_page(tmp_path):
    """Each arm's mean validation curve is flat (less than 1 % of its best over the last fifth), still improving
    or worsening (its last validation more than 1 % above its best), with the step of its best validation; a
    comparison with an arm still improving is marked. A DEQ whose training gradient is more than 5 % off the exact
    one is marked unfaithful. A seed whose log ends before its arm's last validation is left out of the label, and
    named."""
    flat = [[99, -10.0], [199, -20.0], [799, -30.0], [999, -30.2]]  # 0.7 % over the last fifth
    falling = [[99, -10.0], [199, -20.0], [799, -30.0], [999, -33.0]]  # 9.1 %
    rising = [[99, -10.0], [199, -20.0], [799, -30.0], [999, -25.0]]  # 16.7 % above its best, at step 799
    trust = {"contraction": 0.7, "phantom_steps": 2, "neumann_remainder": 0.49, "derivative_rel_error": 0.1,
             "objective_error_scaled": 0.2, "gradient_rel_error": 0.3, "gradient_cosine": 0.95,
             "gradient_norm_ratio": 1.2, "exact_converged": False, "exact_at_floor": True, "capped_solves": 0.0,
             "capped_solves_training": 0.0, "max_iter": 10}
    for seed in range(2):
        write_unit(tmp_path, "nice", "mnist", "explicit", seed, {"bits_per_dim": 5.0 + seed / 10}, curve=flat,
                   device=f"cpu: model {seed}")
        write_unit(tmp_path, "nice", "mnist", "deq", seed, {"bits_per_dim": 5.0 + seed / 10}, trust=trust,
                   curve=falling)
        write_unit(tmp_path, "nice", "mnist", "explicit_deep", seed, {"bits_per_dim": 5.0}, curve=rising)
    # its last rows lost (a resume dropped them): the arm's other seeds would otherwise be cut at step 799 too
    write_unit(tmp_path, "nice", "mnist", "explicit", 2, {"bits_per_dim": 5.0}, curve=[[99, -9.0], [799, -20.0]])
    text = report(tmp_path)
    assert "| flat (+0.7% over the last fifth; best at step 999 of 999; seed 2's log ends at step 799, left out) |" \
        in text
    assert "| worsening (+16.7% above its best; best at step 799 of 999) |" in text
    row = next(line for line in text.splitlines() if "| deq vs explicit (shallow) |" in line)
    assert "**an arm still improving**: still improving (+9.1% over the last fifth; best at step 999 of 999); flat " \
        "(+0.7% over the last fifth; best at step 999 of 999; seed 2's log ends at step 799, left out)" in row
    assert "| mnist | deq | 2 | 0.700 (0.700) | 2 | 0.490 (0.490) | 10.0% (10.0%) | 20.0% (20.0%) | 30.0% (30.0%) " \
           "| 0.950 (0.950) | 1.200 (1.200) | 0.0% (0.0%) / 0.0% (0.0%) | 0 of 2 converged, 2 at float32's floor " \
           "| **no** (> 5%) |" in text


def test_an_arms_learning_rate_at_an_end_of_its_grid_is_marked(tmp_path):
    """The rate an arm trained at is read from its units' arguments; one at the grid's largest or smallest value
    is marked so, one inside it is not."""
    rule = PROTOCOL.family("nice")["learning_rate"]
    low, middle, high = sorted(rule["grid"])
    for variant, rate in (("explicit", high), ("deq", middle), ("deq_implicit", low)):
        for seed in range(2):
            write_unit(tmp_path, "nice", "mnist", variant, seed, {"bits_per_dim": 5.0})
            path = core.unit_path(tmp_path, "nice", "mnist", variant, seed)
            unit = json.loads(path.read_text())
            unit["value"]["arguments"] = [f"{rule['option']}={rate!r}"]
            path.write_text(json.dumps(unit))
    rows = {}
    for line in report(tmp_path).splitlines():  # the arm table comes first
        if line.startswith("| mnist | "):
            rows.setdefault(line.split(" | ")[1], line)
    assert f"| {high!r} (the grid's largest) |" in rows["explicit"]
    assert f"| {middle!r} |" in rows["deq"] and "the grid's" not in rows["deq"]
    assert f"| {low!r} (the grid's smallest) |" in rows["deq_implicit"]


def test_an_implicit_deqs_trust_row_names_its_backward_and_shows_its_millionths(tmp_path):
    """An implicit DEQ trains on the exact derivatives: its row shows the backward, not phantom steps, and its
    gradient error at the precision it has (0.0 % would hide 3.7e-6)."""
    trust = {"contraction": 0.7, "phantom_steps": 2, "neumann_remainder": 0.49, "derivative_rel_error": 2e-7,
             "objective_error_scaled": 1e-7, "gradient_rel_error": 3.7e-6, "gradient_cosine": 1.0,
             "gradient_norm_ratio": 1.0, "exact_converged": True, "capped_solves": 0.0,
             "capped_solves_training": 0.0, "max_iter": 10, "backward": "implicit"}
    write_unit(tmp_path, "nice", "mnist", "deq_implicit", 0, {"bits_per_dim": 5.0}, trust=trust)
    row = next(line for line in report(tmp_path).splitlines() if line.startswith("| mnist | deq_implicit | 1 | 0.700"))
    assert row.startswith("| mnist | deq_implicit | 1 | 0.700 (0.700) | implicit | – | 2e-05% (2e-05%) | "
                          "1e-05% (1e-05%) | 0.0004% (0.0004%) |"), row


def test_a_deq_whose_reference_solve_did_not_converge_is_unverified_not_faithful(tmp_path):
    """A gradient error under the threshold says nothing where the reference it is measured against did not
    converge (a map that no longer contracts at its fixed point): such an arm is unverified; a reference stalled at
    float32's floor counts as converged, and an error over the threshold stays a no."""
    base = {"contraction": 1.85, "phantom_steps": 2, "neumann_remainder": 3.4, "derivative_rel_error": 0.01,
            "objective_error_scaled": 0.003, "gradient_rel_error": 0.043, "gradient_cosine": 0.999,
            "gradient_norm_ratio": 0.996, "exact_converged": False, "exact_at_floor": False, "capped_solves": 1.0,
            "capped_solves_training": 0.5, "max_iter": 30, "backward": "ift", "exact_reference": "implicit"}
    arms = {"deq": base, "deq_implicit": base | {"exact_at_floor": True},
            "deq_reference": base | {"gradient_rel_error": 0.3}}
    for variant, trust in arms.items():
        write_unit(tmp_path, "nice", "mnist", variant, 0, {"bits_per_dim": 5.0}, trust=trust)
    rows = {line.split(" | ")[1]: line for line in report(tmp_path).splitlines()
            if line.startswith("| mnist | deq") and "converged" in line}
    assert rows["deq"].endswith("| 0 of 1 converged, 1 by the implicit derivative (the unrolled solve diverged) | "
                                "**unverified** (a reference solve did not converge: no exact gradient to measure "
                                "against) |"), rows["deq"]
    assert rows["deq_implicit"].endswith("at float32's floor | yes |"), rows["deq_implicit"]
    assert rows["deq_reference"].endswith("| **no** (> 5%) |"), rows["deq_reference"]


def test_the_page_states_the_protocol_and_its_deviations(tmp_path):
    write_unit(tmp_path, "vae", "mnist", "explicit", 0, {"ais_log_likelihood": -100.0})
    text = report(tmp_path)
    assert f"`benchmarks/protocol/v{PROTOCOL.version}.json` (SHA-256 `{PROTOCOL.sha256}`)" in text
    assert "## Deviations" in text and text.count("| after v1 results |") == 3
    assert "| vae | ais_log_likelihood | higher | 1.0 nats | 1.0 x |" in text


def test_units_of_another_protocol_are_refused(tmp_path, capsys):
    write_unit(tmp_path, "nice", "mnist", "explicit", 0, {"bits_per_dim": 5.0})
    path = core.unit_path(tmp_path, "nice", "mnist", "explicit", 0)
    unit = json.loads(path.read_text())
    unit["settings"]["protocol"] = {"version": 1, "sha256": "x"}
    path.write_text(json.dumps(unit))
    with pytest.raises(SystemExit):
        report(tmp_path)
    assert f"not recorded under protocol v{PROTOCOL.version}" in capsys.readouterr().err


def later_protocol(folder, change) -> tuple[protocol.Protocol, protocol.Protocol]:
    """In ``folder``: the current protocol as version 1 and version 2 = version 1 changed by ``change(text)``."""
    folder.mkdir(parents=True, exist_ok=True)
    text = json.loads(PROTOCOL.path.read_text())
    for version in (1, 2):
        text["version"] = version
        (folder / f"v{version}.json").write_text(json.dumps(text))
        change(text)
    return protocol.load(folder / "v1.json"), protocol.load(folder / "v2.json")


def add_variant(text):
    text["families"]["vae"]["seeds"]["deq_wide"] = 2


def test_a_unit_of_an_earlier_version_counts_only_where_that_version_governs_it_alike(tmp_path):
    earlier, later = later_protocol(tmp_path / "a", add_variant)
    unit = {"family": "vae", "variant": "deq", "settings": {"protocol": earlier.stamp}}
    assert later.governs(unit) and earlier.governs(unit)  # a variant added beside it leaves it as it was
    assert not later.governs({**unit, "variant": "deq_wide"})  # 0 seeds then, 2 now
    assert not earlier.governs({**unit, "settings": {"protocol": later.stamp}})  # never backwards
    assert not later.governs({**unit, "settings": {"protocol": {**earlier.stamp, "sha256": "0" * 64}}})  # edited
    earlier, later = later_protocol(tmp_path / "b", lambda text: text["families"]["vae"].update(budget=2.0))
    unit = {"family": "vae", "variant": "deq", "settings": {"protocol": earlier.stamp}}
    assert not later.governs(unit)
    assert later.governs({**unit, "family": "nice"})  # another family's units keep counting
    earlier, later = later_protocol(tmp_path / "c", lambda text: text["trust"].update(faithful_below=0.1))
    assert not later.governs({"family": "nice", "variant": "deq", "settings": {"protocol": earlier.stamp}})


def test_a_carried_unit_is_read_back_not_run_again_and_shares_its_table(tmp_path, monkeypatch):
    """Under a later version that governs it alike, a recorded unit is what the study returns, and the report
    tables it with the later version's units; a changed setting, config, override or code commit runs it again."""
    earlier, later = later_protocol(tmp_path / "protocol", add_variant)
    family, entry = FAMILIES["vae"], later.family("vae")
    settings = [entry["budget"], later.validations, entry["evaluation"], tuple(entry["fit"])]
    code = {"commit": "a" * 40, "uncommitted_changes": False}
    out = tmp_path / "out"
    for seed, stamped in enumerate((earlier, later)):
        write_unit(out, "vae", "mnist", "deq", seed, {"ais_log_likelihood": -100.0 - seed})
        path = core.unit_path(out, "vae", "mnist", "deq", seed)
        unit = json.loads(path.read_text())
        unit_settings = core.UnitSettings(stamped, *settings)
        unit["settings"] = json.loads(json.dumps(unit_settings.recorded_as(family)))
        arguments = core.fit_arguments(family, "mnist", "deq", seed, unit_settings)
        unit |= {"fit": core.fit_record(family, "deq", arguments), "code": code}
        path.write_text(json.dumps(unit))

    def train_and_evaluate(*args, **kwargs):
        raise AssertionError("ran")

    monkeypatch.setattr(core, "train_and_evaluate", train_and_evaluate)
    run = functools.partial(core.run_unit, family, "mnist", "deq", 0, runs_root=tmp_path, out=out)
    carried = run(core.UnitSettings(later, *settings), facts={"code": code})
    assert carried["settings"]["protocol"] == earlier.stamp
    for change in (dict(settings=core.UnitSettings(later, 2.0, *settings[1:])),  # another budget
                   dict(learning_rate=("--model.init_args.score_optimizer.init_args.lr", 3e-4)),  # an override
                   dict(facts={"code": {**code, "commit": "b" * 40}})):  # another commit (unknown to git)
        kwargs = {"settings": core.UnitSettings(later, *settings), "facts": {"code": code}} | change
        with pytest.raises(AssertionError, match="ran"):
            run(**kwargs)
    monkeypatch.setattr(core, "fit_record", lambda *a: {"config_sha256": "0" * 64, "arguments": []})
    with pytest.raises(AssertionError, match="ran"):  # another composed config
        run(core.UnitSettings(later, *settings), facts={"code": code})
    designs = report_module.load_units(out, family, later)
    assert [u["seed"] for u in designs[later.version][1]] == [0, 1] and designs[later.version][2] == 0


def test_a_unit_of_an_earlier_design_is_kept_beside_the_one_that_takes_its_place(tmp_path, monkeypatch):
    """A unit its protocol no longer governs moves, with its sample grid and its rerun, to <group>/v<version>/
    when a newer design's unit is recorded in its place, and each design is judged on its own units; a unit run
    again within its design is replaced; a second unit of one design and seed is refused by name."""
    earlier, later = later_protocol(tmp_path / "protocol", lambda text: text["families"]["vae"].update(budget=2.0))
    family, code = FAMILIES["vae"], {"commit": "a" * 40, "uncommitted_changes": False}
    out, group_dir = tmp_path / "out", tmp_path / "out" / "vae" / "mnist"

    def settings_of(stamped):
        entry = stamped.family("vae")
        return core.UnitSettings(stamped, entry["budget"], stamped.validations, entry["evaluation"],
                                 tuple(entry["fit"]))

    write_unit(out, "vae", "mnist", "deq", 0, {"ais_log_likelihood": -100.0})
    path = core.unit_path(out, "vae", "mnist", "deq", 0)
    unit = json.loads(path.read_text())
    value = unit["value"]
    unit["settings"] = json.loads(json.dumps(settings_of(earlier).recorded_as(family)))
    path.write_text(json.dumps(unit))
    path.with_suffix(".png").write_bytes(b"grid")
    (group_dir / "reruns").mkdir()
    (group_dir / "reruns" / path.name).write_text(json.dumps(unit | {"value": value | {"metrics": {
        "ais_log_likelihood": -100.5}}}))
    monkeypatch.setattr(core, "train_and_evaluate",
                        lambda *a, **k: value | {"metrics": {"ais_log_likelihood": -90.0}})
    run = functools.partial(core.run_unit, family, "mnist", "deq", 0, settings_of(later), runs_root=tmp_path,
                            out=out)
    assert run(facts={"code": code})["value"]["metrics"]["ais_log_likelihood"] == -90.0
    kept = group_dir / "v1" / path.name
    assert json.loads(kept.read_text())["value"]["metrics"]["ais_log_likelihood"] == -100.0
    assert kept.with_suffix(".png").read_bytes() == b"grid" and not path.with_suffix(".png").exists()
    assert (group_dir / "v1" / "reruns" / path.name).exists() and not (group_dir / "reruns" / path.name).exists()
    designs = report_module.load_units(out, family, later)
    assert {v: [(u["seed"], u["value"]["metrics"]["ais_log_likelihood"]) for u in d[1]]
            for v, d in designs.items()} == {2: [(0, -90.0)], 1: [(0, -100.0)]}
    grids = {v: "\n".join(tables.sample_grids(family, d[1], str)) for v, d in designs.items()}
    assert str(kept.with_suffix(".png")) in grids[1] and "png" not in grids[2]  # each design's own grid
    spread = {v: "\n".join(tables.reruns_table(family, family.judged(later), d[1])) for v, d in designs.items()}
    assert "| -100.0 | -100.5 |" in spread[1] and "no rerun recorded" in spread[2]
    stale = shutil.copy(group_dir / "v1" / "reruns" / path.name, group_dir / "reruns" / path.name)
    assert "no rerun recorded" in "\n".join(tables.reruns_table(family, family.judged(later), designs[2][1]))
    Path(stale).unlink()  # a rerun of the earlier unit, at the newer one's place: not paired with it
    run(facts={"code": {**code, "commit": "b" * 40}})  # the same design run again (another commit): replaced
    assert sorted(p.name for p in group_dir.iterdir()) == ["deq_s0.json", "reruns", "v1"]
    later_unit = path.read_text()
    shutil.copy(kept, path)  # by hand: the earlier unit again at the newer one's place, while v1 holds it
    with pytest.raises(protocol.ProtocolError, match=re.escape(f"{kept}: already holds a unit of that version")):
        run(facts={"code": code})
    assert path.read_text() == kept.read_text() and path.exists()  # refused before anything moved
    path.write_text(later_unit)
    shutil.copytree(group_dir / "v1", group_dir / "v9")  # the earlier unit twice
    with pytest.raises(protocol.ProtocolError, match="v9/deq_s0.json: a second unit of vae/mnist/deq seed 0"):
        report_module.load_units(out, family, later)


def test_code_is_alike_only_where_the_change_misses_the_familys_code(monkeypatch):
    """The same commit with the same uncommitted changes holds; other changes do not; between two clean commits,
    a diff of another family's files or of the page's holds, and one of shared or the family's code does not;
    uncommitted changes that a later commit holds exactly are that commit."""
    names = list(FAMILIES)
    clean = {"commit": "a" * 40, "uncommitted_changes": False}
    edited = {"commit": "a" * 40, "uncommitted_changes": True, "changes_sha256": "1" * 64}
    assert core.code_alike(clean, clean, "vae", names) and core.code_alike(edited, edited, "vae", names)
    assert not core.code_alike(edited, edited | {"changes_sha256": "2" * 64}, "vae", names)
    assert not core.code_alike(clean, edited, "vae", names) and not core.code_alike(None, clean, "vae", names)
    other = {"commit": "b" * 40, "uncommitted_changes": False}
    for changed, alike in ((["deqscore/models/ncsn.py", "configs/dkef/deq.yaml", "lab/deqlab/study/report.py"], True),
                           (["deqscore/models/vae.py"], False), (["deqscore/deq/layer.py"], False), (None, False)):
        monkeypatch.setattr(core, "changed_code", lambda a, b, changed=changed: changed)
        assert core.code_alike(clean, other, "vae", names) == alike, changed
    # a run of uncommitted changes that a later commit holds exactly counts as that commit; else as nothing
    monkeypatch.setattr(core, "changed_code", lambda a, b: ["deqscore/deq/layer.py"])
    for holder, alike in (("b" * 40, True), ("c" * 40, False), (None, False)):
        monkeypatch.setattr(core, "committed_as", lambda commit, sha, holder=holder: holder)
        assert core.code_alike(edited, other, "vae", names) == alike, holder


@pytest.mark.parametrize("args, message", [
    (["--family", "nce"], "--family: unknown ['nce']"),
    (["--family", "ncsn", "--set", "steps=3"], "--set steps=3: expected KEY=VALUE with KEY one of ais_chains"),
    (["--family", "nice", "--variants", "deq,deq_full"], "--variants: unknown ['deq_full']"),
    (["--family", "nice", "--budget", "0"], "--budget: a positive fraction"),
    (["--family", "nice", "--budget", "inf"], "--budget: a positive fraction"),
    (["--family", "ncsn", "--set", "samples=many"], "--set samples=many: samples takes a int, got 'many'"),
    (["--family", "ncsn", "--set", "samples"], "--set samples: expected KEY=VALUE"),
    (["--family", "ncsn", "--set", "weights=ema"], "--set weights=ema: weights takes one of trained, averaged"),
    (["--family", "dkef", "--set", "log_z_proposal=flow"], "log_z_proposal takes one of gaussian, mixture"),
    (["--family", "nice", "--seeds", ","], "--seeds takes comma-separated integers"),
    (["--family", "nice", "--jobs", "0"], "--jobs: a number of processes, at least 1, got 0"),
    (["--family", "dkef,nice", "--groups", "redwine"], "--groups: unknown ['redwine']; choose from mnist"),
    ([], "name the families to run"),
    (["--report"], "no unit files (<family>/<data>/<variant>_s<seed>.json) to report on"),
    (["--family", "nice", "--protocol", "benchmarks/protocol/v9.json"], "--protocol benchmarks/protocol/v9.json"),
])
def test_usage_errors_name_the_option_and_the_choices(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit):
        main(["study", *args, "--out", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_the_untrained_network_is_a_control_not_an_override(tmp_path):
    """NCSN: the verdict on the held-out denoising loss (the protocol's metric); the trained variants' KID as a
    fraction of the untrained network's beside it (its control metric), which never overrides the verdict."""
    def write(variant: str, losses: list[float], kids: list[float]) -> None:
        for seed, (loss, kid) in enumerate(zip(losses, kids, strict=True)):
            write_unit(tmp_path, "ncsn", "mnist", variant, seed, {"dsm_every_level": loss, "kid": kid})

    write("untrained", [900.0, 910.0, 920.0], [0.50, 0.52, 0.54])
    write("explicit", [200.0, 202.0, 204.0], [0.40, 0.42, 0.44])
    write("deq", [200.0, 201.0, 202.0], [0.40, 0.41, 0.42])
    text = report(tmp_path)
    assert "Control: each trained variant's KID as a fraction of the untrained network's (0.520): explicit 0.81, " \
           "deq 0.79." in text
    assert "the samples are called digits when a variant's KID is at most a tenth" in text
    # margin: 2 % of the shallow network's held-out loss (4.04); the DEQ is better by 1: the verdict is given
    assert "**The verdicts** (held-out DSM loss (every level), margin" in text
    assert "| mnist | deq vs explicit (shallow) | 3 of 5 / 3 of 5 | +1 ±" in text and "| 4.040 | interim: **" in text


def test_the_samplers_cost_cold_and_warm_reaches_the_page(tmp_path):
    """Per DEQ arm: evaluations per sample, solver iterations per evaluation and per sample (their product), cold
    and warm, their means over seeds, and the warm start's saving (cold over warm)."""
    for seed, (cold, warm) in enumerate([(8.0, 6.0), (9.0, 7.0)]):
        cost = {"evaluations_per_sample": 201.0, "iterations_per_evaluation_cold": cold,
                "iterations_per_evaluation_warm": warm, "iterations_per_sample_cold": 201 * cold,
                "iterations_per_sample_warm": 201 * warm}
        write_unit(tmp_path, "ncsn", "mnist", "deq", seed, {"dsm_every_level": 200.0, "kid": 0.4,
                                                            "sampling_cost": cost})
    write_unit(tmp_path, "ncsn", "mnist", "explicit", 0, {"dsm_every_level": 200.0, "dsm_every_level_se": 0.5,
                                                          "kid": 0.4, "kid_std": 0.001, "kid_se": 0.02})
    text = report(tmp_path)
    assert "| mnist | deq | 2 | 201 | 8.50 | 6.50 | 1,708 | 1,306 | 1.31x |" in text
    assert "| mnist | explicit | 1 | 201 |" not in text
    # a run's own standard errors in the per-run table (KID's over sample blocks, not its subsets' spread)
    assert "| mnist | explicit | 0 | 200.000 ± 0.500 | 0.400 ± 0.020 |" in text
    assert "± beside a run's metric: that run's own standard error" in text


@pytest.mark.parametrize("kept_low_rate", [False, True])
def test_the_deq_arms_solves_at_each_tuned_rate_reach_the_page(tmp_path, kept_low_rate):
    """Per DEQ arm, its tuning runs' forward solves converged at the last validation, their relative residual (the
    last validation's, not the first) and IFT backward misses at every rate of the grid, the rate its validation
    figure chose in bold (the lowest last loss here, a rate whose solves stopped converging), – for a backward that
    is no IFT; an explicit arm's tuning (no solver) has no row. A run kept under ``<group>/v<version>/tuning/``
    (where a newer design's run of its rate moved it) still counts for its own design."""
    rule = PROTOCOL.family("edm")["learning_rate"]
    write_unit(tmp_path, "edm", "mnist", "deq", 0, {"loss": 0.2, "kid": 0.05})
    low, middle, high = sorted(rule["grid"])
    # loss, converged, their relative residual, misses
    solves = {low: (0.30, 1.0, 4.1e-4, 0.11), middle: (0.25, 0.0, 0.0052, 0.55), high: (0.20, 0.0, 0.0092, None)}
    tuning = tmp_path / "edm" / "mnist" / "tuning"
    tuning.mkdir()
    for variant in ("deq", "explicit"):
        for rate, (loss, converged, residual, misses) in solves.items():
            validation = {"val/loss": [[9, 1.0], [19, loss]]}
            if variant == "deq":
                validation["val/deq/converged"] = [[9, 1.0], [19, converged]]
                validation["val/deq/rel_residual"] = [[9, 1e-4], [19, residual]]
            run = {"family": "edm", "group": "mnist", "variant": variant, "seed": 1000,
                   "settings": {"protocol": PROTOCOL.stamp},
                   "value": {"arguments": [f"{rule['option']}={rate!r}"], "validation": validation,
                             "ift_backward_failures": misses if variant == "deq" else None}}
            folder = tuning.parent / "v1" / "tuning" if kept_low_rate and rate == low else tuning
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{variant}_lr{rate!r}_s1000.json").write_text(json.dumps(run))
    text = report(tmp_path)
    assert (f"| mnist | deq | {high:g} | {low:g}: 1.00, {middle:g}: 0.00, **{high:g}: 0.00** | "
            f"{low:g}: 0.00041, {middle:g}: 0.0052, **{high:g}: 0.0092** | "
            f"{low:g}: 0.11, {middle:g}: 0.55, **{high:g}: –** |") in text
    assert "| mnist | explicit | " not in text.split("**The DEQ arms' solves")[1].split("\n\n")[1]


@pytest.mark.parametrize("weights, raw", [("trained", True), ("averaged", False)])
def test_ncsn_samples_from_the_weights_its_evaluation_names(tmp_path, monkeypatch, weights, raw):
    """``weights=trained`` must reach ``sample.py`` as ``--raw-weights``; the protocol scores the trained weights."""
    from deqlab.families import ncsn as ncsn_bench
    from deqlab.study import evaluation as study_evaluation

    passed = []

    def draw(checkpoint, out, n, seed, options=()):
        passed.extend(options)
        out.mkdir(parents=True)
        (out / "fid.json").write_text(json.dumps({"kid": 0.1, "kid_std": 0.01, "kid_se": 0.02, "kid_subset_size": 4,
                                                  "fid": 9.0, "num_samples": n, "reference": "r"}))

    monkeypatch.setattr(study_evaluation, "draw_samples", draw)
    monkeypatch.setattr(study_evaluation, "sampler_cost", lambda checkpoint, evaluation: None)  # no checkpoint here
    run = tmp_path / "runs" / "ncsn" / "mnist" / "deq_s0"
    evaluation = PROTOCOL.family("ncsn")["evaluation"] | {"weights": weights, "held_out": False}
    ncsn_bench.evaluate(run, run / "last.ckpt", FAMILIES["ncsn"].variants["deq"], 0, evaluation)
    assert ("--raw-weights" in passed) == raw
    assert PROTOCOL.family("ncsn")["evaluation"]["weights"] == "average"  # v7: a short average (decay 0.99)


def test_ncsn_held_out_loss_is_every_test_image_at_every_level_and_the_same_twice(tmp_path):
    """A tiny DEQ NCSN trained two epochs of 3 steps: the held-out evaluation reads train.py test's every-level
    figures (the mean is the mean of the levels, a standard error over the images), the noise fixed, so a second
    evaluation of the same weights gives the same numbers; a DEQ's trust figures come with them."""
    from deqlab.families import ncsn as ncsn_bench
    from deqscore.cli.train import main as train
    from tests.lightning.conftest import tiny_args

    run = tmp_path / "t"
    train(["fit", *tiny_args(tmp_path, "configs/ncsn/deq_mnist.yaml"), "--trainer.max_epochs", "2"])
    checkpoint = run / "checkpoints" / "last.ckpt"
    evaluation = {"levels": 3, "test_images": 16}
    first = ncsn_bench.held_out(run, checkpoint, evaluation)
    again = ncsn_bench.held_out(run, checkpoint, evaluation)
    assert len(first["dsm_per_level"]) == 3 and first["dsm_every_level_se"] > 0
    assert math.isclose(first["dsm_every_level"], sum(first["dsm_per_level"]) / 3, rel_tol=1e-5)
    assert {k: first[k] for k in ("dsm_every_level", "dsm_per_level")} == \
        {k: again[k] for k in ("dsm_every_level", "dsm_per_level")}
    assert "contraction" in first["trust"]
    # the protocol's weights: the trained ones where it says so (the run averaged them: the checkpoint holds both)
    trained = ncsn_bench.held_out(run, checkpoint, evaluation | {"weights": "trained"})
    assert trained["dsm_every_level"] != first["dsm_every_level"]


def test_the_committed_results_page_is_what_the_report_writes(tmp_path, monkeypatch):
    """docs/results.md is generated: a change to the report, the protocol or the units that is not written out fails."""
    from deqlab.study import report

    for name in ("results/study", "results/depth", "protocol"):  # a copy: the report writes figures beside the units
        shutil.copytree(core.ROOT / "benchmarks" / name, tmp_path / "benchmarks" / name)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    copied = protocol.load(tmp_path / PROTOCOL.path.relative_to(core.ROOT))
    text = report.write_page(tmp_path / "benchmarks" / "results" / "study", tmp_path / "docs" / "results.md",
                             list(FAMILIES.values()), copied)
    assert text == (core.ROOT / "docs" / "results.md").read_text()


def test_a_unit_rerun_with_the_same_seed_code_and_threads_is_bit_identical(tmp_path):
    """The same tiny DKEF unit trained and evaluated twice (fresh run directories, one process, the protocol's
    thread count) gives the same metrics and learning curve bit for bit, and the page shows the rerun as such;
    another seed gives other numbers (the seed reaches the run)."""
    units = run_study(tmp_path, "dkef", "--variants", "explicit")["dkef"]
    other_seed = run_study(tmp_path, "dkef", "--variants", "explicit", "--seeds", "1")["dkef"]
    assert other_seed[0]["value"]["metrics"]["log_likelihood"] != units[0]["value"]["metrics"]["log_likelihood"]
    reruns = run_study(tmp_path, "dkef", "--variants", "explicit", "--rerun")["dkef"]
    assert reruns[0]["value"]["metrics"] == units[0]["value"]["metrics"]
    assert reruns[0]["value"]["curves"] == units[0]["value"]["curves"]
    assert (tmp_path / "out" / "dkef" / "redwine" / "reruns" / "explicit_s0.json").exists()
    page = tmp_path / "results.md"
    main(["study", "--report", "--out", str(tmp_path / "out"), "--page", str(page)])
    log_likelihood = units[0]["value"]["metrics"]["log_likelihood"]
    assert f"| redwine | explicit | 0 | {log_likelihood!r} | {log_likelihood!r} | 0.000 | **yes** | 1 / 1 |" in \
        page.read_text()


def test_a_unit_stopped_part_way_continues_from_its_checkpoint_and_gives_the_uninterrupted_result(
        tmp_path, monkeypatch):
    """A tiny DKEF unit preempted by a real SIGTERM after its first step saves its state; the study launched again
    continues that run (not a fresh one) and records what an uninterrupted unit records, bit for bit. A run left by
    another launch is moved aside, never continued."""
    from deqscore.lightning.callbacks import Preempted

    from .preempt import FLAG

    def study(root: str) -> list[dict]:
        return dkef_explicit_s0(tmp_path / root, "--trainer.callbacks+=tests.lab.preempt.PreemptOnce")["dkef"]

    whole = study("whole")
    flag = tmp_path / "preempt"
    flag.write_text("")
    monkeypatch.setenv(FLAG, str(flag))
    with pytest.raises(Preempted):
        study("cut")
    run = tmp_path / "cut" / "runs" / "dkef" / "redwine" / "explicit_s0"
    assert torch.load(run / "checkpoints" / "interrupted.ckpt", weights_only=False)["global_step"] == 1
    cut = study("cut")
    assert cut[0]["value"]["resumed_at_step"] == 1 and not flag.exists()
    assert cut[0]["value"]["metrics"] == whole[0]["value"]["metrics"]
    assert cut[0]["value"]["curves"] == whole[0]["value"]["curves"]
    page = tmp_path / "results.md"
    main(["study", "--report", "--out", str(tmp_path / "cut" / "out"), "--page", str(page)])
    assert " (resumed at step 1) |" in page.read_text()
    # another launch (here: other code) finds the run and moves it aside
    unit = tmp_path / "cut" / "out" / "dkef" / "redwine" / "explicit_s0.json"
    unit.unlink()
    launch = json.loads((run / core.LAUNCH_FILE).read_text())
    (run / core.LAUNCH_FILE).write_text(json.dumps({**launch, "code": {"commit": "0" * 40}}))
    assert "resumed_at_step" not in study("cut")[0]["value"]
    assert (run.parent / "explicit_s0.1").is_dir()


def test_a_unit_another_process_runs_is_refused_in_one_line_before_its_run_is_touched(tmp_path, capsys):
    """Two study commands that reach the same unit: the second is refused by the unit's lock, in one line naming
    its run directory, before it reads or moves the holder's run (here one without a checkpoint yet, which a launch
    of its own would move aside)."""
    from deqscore.lightning.runs import RunLock

    run = tmp_path / "runs" / "dkef" / "redwine" / "explicit_s0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("step\n")
    with RunLock(run), pytest.raises(SystemExit) as stop:  # held: another open file of this lock's is refused
        dkef_explicit_s0(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1
    assert f"run directory {run} is in use by process {os.getpid()}; run the study again" in err[0]
    assert (run / "metrics.csv").exists() and sorted(p.name for p in run.parent.iterdir()) == ["explicit_s0"]


def test_a_unit_whose_data_cannot_be_read_stops_the_study_in_one_line(tmp_path, capsys):
    """A data file met inside a unit's fit that cannot be decoded: the study stops with train.py's one line naming
    the file (exit status 2), no traceback, and records no unit."""
    data = tmp_path / "uci"
    data.mkdir()
    (data / "winequality-red.csv").write_text("not;a;wine;table\n1;2\n")
    with pytest.raises(SystemExit) as stop:
        dkef_explicit_s0(tmp_path, f"--data.init_args.root={data}")
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("python -m deqlab study: error: ") and "winequality-red.csv" in err[0]
    assert not list((tmp_path / "out").rglob("*.json"))


def test_each_arm_trains_at_the_rate_its_validation_chose(tmp_path, monkeypatch):
    """Tuning runs at every rate of the grid and the tuning seed (recorded under tuning/), then the unit at the
    rate with the best validation figure; a tie keeps the smaller rate."""
    from deqlab.study import tuning

    assert tuning.best_rate({1e-3: [2.0], 3e-3: [1.0], 1e-2: [1.0]}, "lower") == 3e-3
    assert tuning.best_rate({1e-3: [2.0], 3e-3: [1.0]}, "higher") == 1e-3
    unit = {"family": "x", "variant": "y", "value": {"validation": {"val/loss": [[9, -1.0], [19, -3.0], [29, -2.0]]}}}
    assert tuning.validation_figure(unit, {"validation": "val/loss", "better": "lower", "at": "best"}) == -3.0
    assert tuning.validation_figure(unit, {"validation": "val/loss", "better": "lower", "at": "last"}) == -2.0
    family, options_fit = FAMILIES["dkef"], fixture_file("dkef").STUDY_TINY
    figures = {1e-3: -1.0, 3e-3: -5.0, 1e-2: -2.0}  # validation losses by rate: 3e-3 is best
    monkeypatch.setattr(tuning, "validation_figure", lambda unit, rule: figures[rate_of(unit)])
    units = main(["study", "--family", "dkef", "--budget", str(2 / family.iterations), "--runs-root",
                  str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--variants", "explicit",
                  *options_fit[0], "--extra", *QUIET, *options_fit[1]])["dkef"]
    option = PROTOCOL.family("dkef")["learning_rate"]["option"]
    assert f"{option}=0.003" in units[0]["value"]["arguments"] and units[0]["settings"]["learning_rate"] == "tuned"
    tuned = sorted(p.name for p in (tmp_path / "out" / "dkef" / "redwine" / "tuning").glob("*.json"))
    assert tuned == ["explicit_lr0.001_s1000.json", "explicit_lr0.003_s1000.json", "explicit_lr0.01_s1000.json"]


def rate_of(unit: dict) -> float:
    option = PROTOCOL.family(unit["family"])["learning_rate"]["option"]
    return next(float(a.split("=")[1]) for a in unit["fit"]["arguments"] if a.startswith(f"{option}="))


def test_the_judged_and_the_control_metric_are_the_protocol_entrys():
    class Entry:  # a protocol with one family entry
        def __init__(self, entry):
            self.entry = entry

        def family(self, name):
            return self.entry

    ncsn = FAMILIES["ncsn"]
    assert ncsn.judged(Entry({"metric": "kid"})).key == "kid"
    assert ncsn.judged(Entry({"metric": "dsm_every_level", "control_metric": "kid"})).key == "dsm_every_level"
    assert ncsn.control(Entry({"metric": "dsm_every_level", "control_metric": "kid"})).key == "kid"
    assert ncsn.control(Entry({"metric": "fid"})).key == "fid"
    with pytest.raises(ValueError, match="the ncsn study has no metric 'nll'"):
        ncsn.judged(Entry({"metric": "nll"}))


def test_jobs_tune_each_arm_first_then_run_its_units_seed_by_seed():
    import argparse

    from deqlab.study import parallel, program

    parser = argparse.ArgumentParser()
    program.add_arguments(parser)
    args = parser.parse_args(["--family", "ncsn", "--variants", "explicit,untrained", "--seeds", "0,1"])
    jobs = parallel.jobs_of(program.plan_of(parser, args, PROTOCOL))
    rates = PROTOCOL.family("ncsn")["learning_rate"]["grid"]
    tunings = [f"tune ncsn mnist explicit {rate!r}" for rate in rates]
    assert [job.name for job in jobs] == [*tunings, "ncsn mnist explicit s0", "ncsn mnist untrained s0",
                                          "ncsn mnist explicit s1", "ncsn mnist untrained s1"]
    assert [job.waits for job in jobs[len(rates):]] == [tunings, [], tunings, []]  # the control waits for nothing
    assert jobs[0].arguments == ["--family", "ncsn", "--groups", "mnist", "--variants", "explicit", "--tune-rate",
                                 repr(rates[0])]
    assert jobs[-1].arguments[-2:] == ["--seeds", "1"]


@pytest.mark.slow  # ~50 s: two studies; the fast suite keeps the job runner's own test, the failed job's below
@pytest.mark.xdist_group("processes")
def test_units_run_in_parallel_processes_record_what_one_process_records(tmp_path):
    """--jobs 2: each rate's tuning runs in a process of their own, then each unit in one; every unit and tuning
    run records what the same study records in one process, bit for bit (one thread each), the rate its arm's
    validation chose included."""
    family, (options, fit) = FAMILIES["dkef"], fixture_file("dkef").STUDY_TINY

    def study(folder: str, *more: str) -> list[dict]:
        return main(["study", "--family", "dkef", "--variants", "explicit", "--budget", str(2 / family.iterations),
                     "--runs-root", str(tmp_path / folder / "runs"), "--out", str(tmp_path / folder / "out"),
                     *options, "--seeds", "0", *more, "--extra", *QUIET, *fit])["dkef"]

    one, many = study("one"), study("many", "--jobs", "2")
    assert [u["seed"] for u in one] == [u["seed"] for u in many] == [0]
    for a, b in zip(one, many, strict=True):
        assert a["fit"] == b["fit"] and a["value"]["metrics"] == b["value"]["metrics"]
    tuning = [tmp_path / folder / "out" / "dkef" / "redwine" / "tuning" for folder in ("one", "many")]
    names = sorted(p.name for p in tuning[0].glob("*.json"))
    assert len(names) == 3 and names == sorted(p.name for p in tuning[1].glob("*.json"))
    for name in names:
        assert json.loads((tuning[0] / name).read_text())["value"]["validation"] == \
            json.loads((tuning[1] / name).read_text())["value"]["validation"]
    assert len(list((tmp_path / "many" / "runs" / "jobs").glob("*.log"))) == 3 + 1


@pytest.mark.xdist_group("processes")
def test_a_failed_job_ends_the_call_with_one_line_naming_it_and_its_arms_units_never_start(tmp_path, capsys):
    family, options = FAMILIES["dkef"], fixture_file("dkef").STUDY_TINY[0]
    with pytest.raises(SystemExit) as stop:
        main(["study", "--family", "dkef", "--variants", "explicit", "--budget", str(2 / family.iterations),
              "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *options, "--jobs", "2",
              "--extra", "--trainer.max_stepz=3"])
    logs = tmp_path / "runs" / "jobs"
    assert str(stop.value) == (f"study: 3 of 4 jobs failed (tune dkef redwine explicit 0.001, tune dkef redwine "
                               f"explicit 0.003, tune dkef redwine explicit 0.01); their output is in {logs}")
    printed = capsys.readouterr().out
    assert "skipped  dkef redwine explicit s0 (its arm's tuning failed)" in printed
    assert "[study] 1 of 4 jobs not started" in printed
    assert "max_stepz" in (logs / "tune_dkef_redwine_explicit_0.001.log").read_text()


def test_jobs_wait_for_what_they_need_and_share_the_gpus(tmp_path, monkeypatch):
    """The scheduler alone, on stand-in jobs: at most two at once, each with the shared options; a job waits for
    its tuning and is skipped (not started) where that failed; with two GPUs, each job sees the least used one."""
    import sys

    from deqlab.study.parallel import Job, run_jobs

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    program = [sys.executable, "-c", "import os, sys, time; time.sleep(0.3); "
               "print(os.environ.get('CUDA_VISIBLE_DEVICES'), sys.argv[1:]); sys.exit(3 if 'bad' in sys.argv else 0)"]
    jobs = [Job("a", ["x"]), Job("b", ["bad"]), Job("c", ["z"], waits=["a"]), Job("d", ["w"], waits=["b"])]
    ended = run_jobs(jobs, ["--shared"], 2, tmp_path / "logs", gpus=2, program=program)
    assert ended == {"a": 0, "b": 3, "c": 0, "d": None}
    logs = {name: (tmp_path / "logs" / f"{name}.log").read_text().strip() for name in "abc"}
    assert logs == {"a": "0 ['x', '--shared']", "b": "1 ['bad', '--shared']", "c": "0 ['z', '--shared']"}
    ended = run_jobs(jobs[:1], [], 2, tmp_path / "one", program=program)  # one GPU or none: left as it is
    assert ended == {"a": 0} and (tmp_path / "one" / "a.log").read_text().strip() == "None ['x']"


def test_the_readme_names_the_newest_protocol_where_it_says_so():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    named = re.findall(r"the newest protocol, (benchmarks/protocol/v\d+\.json)", readme)
    assert named == [f"benchmarks/protocol/{protocol.newest().name}"]
