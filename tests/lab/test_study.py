"""The reproduction study end to end at a tiny budget, per family: every unit is recorded with what its run logged
and scored, a recorded unit is not run again, and the page is written from the unit files alone."""

import json
import math
import shutil

import pytest

from deqlab import main
from deqlab.entries import STUDIES
from deqlab.measure import code_version
from deqlab.study import core, protocol
from deqlab.study import report as report_module
from deqlab.study.families import families
from deqlab.study.report import fmt
from deqscore.lightning.callbacks import read_metrics_csv
from tests.families import fixture_file

PROTOCOL = protocol.load()
FAMILIES = families()

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=2"]


def run_study(tmp_path, name: str, *more: str) -> dict:
    family = FAMILIES[name]
    options, fit = fixture_file(name).STUDY_TINY
    return main(["study", "--family", name, "--budget", str(2 / family.iterations), "--runs-root",
                 str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *options, *more, "--extra", *QUIET, *fit])


# NCSN's run (a minute: sampling and Inception features) adds nothing the fast suite lacks: the study machinery is
# covered by the other families, NCSN's sampling and FID by tests/test_sampling.py, its evaluation's options below
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "ncsn" else n for n in FAMILIES])
def test_a_family_study_records_what_its_runs_logged_skips_recorded_units_and_writes_the_page(
        tmp_path, monkeypatch, name):
    family = FAMILIES[name]
    units = run_study(tmp_path, name)[name]
    seeds = [int(s) for s in fixture_file(name).STUDY_TINY[0][1].split(",")]
    group = next(iter(family.groups)) if name != "dkef" else "redwine"
    variants = [v for v in family.variants if PROTOCOL.seeds(name, v)]  # the protocol's
    assert [(u["group"], u["variant"], u["seed"]) for u in units] == [(group, v, s) for s in seeds for v in variants]
    for unit in units:
        variant = family.variants[unit["variant"]]
        path = core.unit_path(tmp_path / "out", name, group, unit["variant"], unit["seed"])
        assert set(json.loads(path.read_text())) == {"family", "group", "variant", "seed", "device", "code",
                                                     "settings", "value"}
        assert unit["code"] == code_version() and len(unit["code"]["commit"]) == 40  # the checkout's commit
        assert unit["family"] == name and unit["device"].startswith("cpu") and unit["settings"]["iterations"] == 2
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
        # a metric the run's test stage logged is reported as logged (NCSN's come from sample.py, below)
        logged = [m.key for m in STUDIES[name].metrics if f"test/{m.key}" in series]
        assert bool(logged) == (variant.trained and name != "ncsn")
        for key in logged:
            assert value["metrics"][key] == pytest.approx(series[f"test/{key}"][-1][1])
        if name == "ncsn":  # the unit holds the scores of the samples sample.py drew
            report = json.loads((run / "samples" / "fid.json").read_text())
            assert (value["metrics"]["kid"], value["metrics"]["fid"]) == (report["kid"], report["fid"])
            assert report["num_samples"] == 4 and "(6 images)" in report["reference"]
        if name == "vae":  # the ELBO only for the Gaussian encoder: the implicit one has none
            assert ("elbo" in value["metrics"]) == (variant.role == "classical")
        assert (value["solver_iterations"] is not None) == ("deq" in variant.role)  # explicit nets have no solver
        trusted = variant.role.startswith("deq") and name != "ncsn"  # measured through train.py test
        assert (value["trust"] is not None) == trusted
        if trusted:
            assert 0 < value["trust"]["contraction"] < 1 and value["trust"]["gradient_rel_error"] >= 0
        assert path.with_suffix(".png").exists() == (name != "dkef")  # the sample grid of an image family
    # the seed reaches the run
    if len(seeds) > 1:
        first = [u for u in units if u["variant"] == "deq"]
        assert first[0]["value"]["metrics"]["log_likelihood"] != first[1]["value"]["metrics"]["log_likelihood"]
    # a second call reads every unit back: nothing is trained again
    monkeypatch.setattr(core, "train_and_evaluate", lambda *a, **k: pytest.fail("a recorded unit was run again"))
    assert run_study(tmp_path, name)[name] == units
    # the page, from the unit files alone
    page = tmp_path / "results.md"
    main(["study", "--report", "--out", str(tmp_path / "out"), "--page", str(page)])
    text = page.read_text()
    metric = family.metrics[0].key
    for unit in units[: len(family.variants)]:
        values = [u["value"]["metrics"][metric] for u in units if u["variant"] == unit["variant"]]
        mean = sum(values) / len(values)
        spread = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1) / len(values)
        cell = fmt(mean) + ("" if len(values) == 1 else f" ± {fmt(math.sqrt(spread))}")
        role = family.variants[unit["variant"]].role
        assert f"| {group} | {unit['variant']} | {role} | {len(values)} | {cell} |" in text
    for figure in (f"curves_{group}.png", "quality_vs_memory.png"):
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
    """DKEF (higher is better, margin 0.1 nats): a DEQ better by 0.2 with small noise holds; one 0.5 worse fails;
    one 0.03 worse with noise that v1's rule passed ('worse by less than one standard error') is inconclusive,
    with the seeds a decision would need; a single seed is not judged."""
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
    assert "| DKEF on UCI data | redwine | deq vs explicit (shallow) | 5 / 5 | +0.2 ± 0.01 |" in text
    assert "| 0.100 | **holds** |" in text and "| 0.100 | **fails** |" in text
    assert "| whitewine | deq vs explicit (shallow) | 5 / 5 | -0.5 ± 0.01 |" in text
    unsure = [line for line in text.splitlines() if line.startswith("| DKEF on UCI data | parkinsons | deq vs "
                                                                     "explicit (shallow)")]
    assert len(unsure) == 1 and "**inconclusive**; " in unsure[0] and "seeds per arm would decide" in unsure[0]
    assert "| parkinsons | deq vs explicit_deep (deep) | 3 / 1 | – |" in text and "fewer than two seeds a side" in text
    assert "| 0.50 |" in text  # the DEQ's memory against the shallow network's


def test_flattened_curves_and_trust_figures_reach_the_page(tmp_path):
    """The shallow network's mean validation curve decides converged / early-training (less than 1 % over the last
    fifth); a DEQ whose training gradient is more than 5 % off the exact one is marked unfaithful."""
    flat = [[99, -10.0], [199, -20.0], [799, -30.0], [999, -30.2]]  # 0.7 % over the last fifth
    falling = [[99, -10.0], [199, -20.0], [799, -30.0], [999, -33.0]]  # 9.1 %
    trust = {"contraction": 0.7, "phantom_steps": 2, "neumann_remainder": 0.49, "derivative_rel_error": 0.1,
             "objective_rel_error": 0.2, "gradient_rel_error": 0.3, "exact_converged": True, "capped_solves": 0.0,
             "capped_solves_training": 0.0, "max_iter": 10}
    for seed in range(2):
        write_unit(tmp_path, "nice", "mnist", "explicit", seed, {"bits_per_dim": 5.0 + seed / 10}, curve=flat,
                   device=f"cpu: model {seed}")
        write_unit(tmp_path, "nice", "mnist", "deq", seed, {"bits_per_dim": 5.0 + seed / 10}, trust=trust)
    text = report(tmp_path)
    assert "converged (+0.7% over the last fifth)" in text
    assert "| mnist | deq | 2 | 0.700 (0.700) | 2 | 0.490 (0.490) | 10.0% (10.0%) | 20.0% (20.0%) | 30.0% (30.0%) " \
           "| 0.0% (0.0%) / 0.0% (0.0%) | 2 of 2 | **no** (> 5%) |" in text
    assert "(time figures from different CPU models are not comparable)" in text
    for seed in range(2):
        write_unit(tmp_path, "nice", "mnist", "explicit", seed, {"bits_per_dim": 5.0}, curve=falling)
        write_unit(tmp_path, "nice", "mnist", "deq", seed, {"bits_per_dim": 5.0},
                   trust=trust | {"gradient_rel_error": 0.01})
    text = report(tmp_path)
    assert "early-training (+9.1% over the last fifth)" in text and "| 2 of 2 | yes |" in text


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
    tables it with the later version's units."""
    earlier, later = later_protocol(tmp_path / "protocol", add_variant)
    family, entry = FAMILIES["vae"], later.family("vae")
    settings = [entry["budget"], later.validations, entry["evaluation"], tuple(entry["fit"])]
    out = tmp_path / "out"
    for seed, stamped in enumerate((earlier, later)):
        write_unit(out, "vae", "mnist", "deq", seed, {"ais_log_likelihood": -100.0 - seed})
        path = core.unit_path(out, "vae", "mnist", "deq", seed)
        unit = json.loads(path.read_text())
        unit["settings"] = json.loads(json.dumps(core.UnitSettings(stamped, *settings).recorded_as(family)))
        path.write_text(json.dumps(unit))

    def train_and_evaluate(*args):
        raise AssertionError("ran")

    monkeypatch.setattr(core, "train_and_evaluate", train_and_evaluate)
    carried = core.run_unit(family, "mnist", "deq", 0, core.UnitSettings(later, *settings), tmp_path, out, {})
    assert carried["settings"]["protocol"] == earlier.stamp
    with pytest.raises(AssertionError, match="ran"):  # other settings: run again
        core.run_unit(family, "mnist", "deq", 0, core.UnitSettings(later, 2.0, *settings[1:]), tmp_path, out, {})
    units, left_out = report_module.load_units(out, family, later)
    assert [u["seed"] for u in units] == [0, 1] and left_out == 0


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
    """NCSN's trained variants as a fraction of the untrained network's KID, beside the verdict, which stands."""
    def write(variant: str, values: list[float]) -> None:
        for seed, v in enumerate(values):
            write_unit(tmp_path, "ncsn", "mnist", variant, seed, {"kid": v})

    write("untrained", [0.50, 0.52, 0.54])
    write("explicit", [0.40, 0.42, 0.44])
    write("deq", [0.40, 0.41, 0.42])
    text = report(tmp_path)
    assert "Control: each trained variant's KID as a fraction of the untrained network's (0.520): explicit 0.81, " \
           "deq 0.79." in text
    assert "the samples are called digits when a variant's KID is at most a tenth" in text
    # margin: 10 % of the shallow network's KID (0.042); the DEQ is better by 0.01: the verdict is given
    assert "| mnist | deq vs explicit (shallow) | 3 / 3 | +0.01 ±" in text and "| 0.042 | **" in text


@pytest.mark.parametrize("weights, raw", [("trained", True), ("averaged", False)])
def test_ncsn_samples_from_the_weights_its_evaluation_names(tmp_path, monkeypatch, weights, raw):
    """``weights=trained`` must reach ``sample.py`` as ``--raw-weights``; the protocol scores the EMA average."""
    from deqlab.families import ncsn as ncsn_bench

    passed = []

    def draw(checkpoint, out, n, seed, options=()):
        passed.extend(options)
        out.mkdir(parents=True)
        (out / "fid.json").write_text(json.dumps({"kid": 0.1, "kid_std": 0.01, "kid_subset_size": 4, "fid": 9.0,
                                                  "num_samples": n, "reference": "r"}))

    monkeypatch.setattr(ncsn_bench, "draw_samples", draw)
    run = tmp_path / "runs" / "ncsn" / "mnist" / "deq_s0"
    evaluation = PROTOCOL.family("ncsn")["evaluation"] | {"weights": weights}
    ncsn_bench.evaluate(run, run / "last.ckpt", FAMILIES["ncsn"].variants["deq"], 0, evaluation)
    assert ("--raw-weights" in passed) == raw
    assert PROTOCOL.family("ncsn")["evaluation"]["weights"] == "averaged"


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
