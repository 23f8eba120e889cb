"""The reproduction study end to end at a tiny budget, per family: every unit is recorded with what its run logged
and scored, a recorded unit is not run again, and the page is written from the unit files alone."""

import json
import math

import pytest

from deqscore.bench import study
from deqscore.bench.study import FAMILIES, core
from deqscore.bench.study.report import fmt
from deqscore.lightning.callbacks import read_metrics_csv

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=2"]
MNIST_SUBSETS = ["--data.init_args.train_subset=48", "--data.init_args.val_subset=16",
                 "--data.init_args.test_subset=16", "--data.init_args.eval_batch_size=16"]
NET = "--model.init_args.net.init_args"
# family -> (study arguments, arguments of every fit)
TINY = {
    "nice": (["--seeds", "0,1", "--set", "exact_sm_images=4"],
             [f"{NET}.hidden=12", f"{NET}.n_layers=3", f"{NET}.n_couplings=2", "--data.init_args.batch_size=16",
              *MNIST_SUBSETS]),
    "dkef": (["--seeds", "0", "--groups", "redwine", "--set", "log_z_samples=2000"],
             [f"{NET}.n_centres=8", f"{NET}.hidden=6", f"{NET}.deep_layers=4", "--model.init_args.alpha_points=40",
              "--model.init_args.log_z_samples=2000", "--model.init_args.log_z_chunk=500",
              "--model.init_args.final_lambda_steps=2", "--model.init_args.exact_sm_batches=1"]),
    "vae": (["--seeds", "0", "--set", "ais_images=4", "--set", "ais_steps=3",
             "--set", "ais_chains=2"],
            [f"{NET}.z_dim=3", f"{NET}.hidden=16", "--model.init_args.val_ais_steps=3",
             "--data.init_args.batch_size=16", *MNIST_SUBSETS]),
    "ncsn": (["--seeds", "0", "--set", "samples=4", "--set", "reference=6"],
             [f"{NET}.ngf=4", "--model.init_args.n_levels=3", "--model.init_args.sampler.init_args.n_steps_each=1",
              "--data.init_args.batch_size=8", "--data.init_args.num_workers=0", *MNIST_SUBSETS]),
}
LOGGED = {"nice": ("log_likelihood", "bits_per_dim", "exact_sm"), "dkef": ("log_likelihood", "log_z_ess", "exact_sm"),
          "vae": ("ais_log_likelihood",), "ncsn": ()}


def run_study(tmp_path, name: str, *more: str) -> dict:
    family = FAMILIES[name]
    options, fit = TINY[name]
    return study.main(["--family", name, "--budget", str(2 / family.iterations), "--runs-root",
                       str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *options, *more,
                       "--extra", *QUIET, *fit])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_study_records_what_its_runs_logged_skips_recorded_units_and_writes_the_page(
        tmp_path, monkeypatch, name):
    family = FAMILIES[name]
    units = run_study(tmp_path, name)[name]
    seeds = [int(s) for s in TINY[name][0][1].split(",")]
    group = next(iter(family.groups)) if name != "dkef" else "redwine"
    assert [(u["group"], u["variant"], u["seed"]) for u in units] == [
        (group, v, s) for s in seeds for v in family.variants]
    for unit in units:
        variant = family.variants[unit["variant"]]
        path = core.unit_path(tmp_path / "out", name, group, unit["variant"], unit["seed"])
        assert set(json.loads(path.read_text())) == {"family", "group", "variant", "seed", "device", "settings",
                                                     "value"}
        assert unit["family"] == name and unit["device"].startswith("cpu") and unit["settings"]["iterations"] == 2
        assert unit["settings"]["budget"] == 2 / family.iterations
        value, run = unit["value"], tmp_path / "runs" / name / group / f"{unit['variant']}_s{unit['seed']}"
        series = read_metrics_csv(run / "metrics.csv") if variant.trained else {}  # untrained: nothing logged
        # trained for the budget (the implicit VAE: 3 optimiser steps per iteration); untrained: not at all
        steps = 2 * variant.steps_per_iteration if variant.trained else 0
        assert value["optimiser_steps"] == steps and value["iterations"] == (2 if variant.trained else 0)
        if variant.trained:
            assert value["parameters"] == series["run/parameters"][-1][1]
            assert value["activation_memory_mb"] == series["run/activation_memory_mb"][-1][1]
        for key in LOGGED[name]:
            assert value["metrics"][key] == pytest.approx(series[f"test/{key}"][-1][1])
        if name == "ncsn":  # the unit holds the scores of the samples sample.py drew
            report = json.loads((run / "samples" / "fid.json").read_text())
            assert (value["metrics"]["kid"], value["metrics"]["fid"]) == (report["kid"], report["fid"])
            assert report["num_samples"] == 4 and "(6 images)" in report["reference"]
        if name == "vae":  # the ELBO only for the Gaussian encoder: the implicit one has none
            assert ("elbo" in value["metrics"]) == (variant.role == "classical")
        assert (value["solver_iterations"] is not None) == ("deq" in variant.role)  # explicit nets have no solver
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
    study.main(["--report", "--out", str(tmp_path / "out"), "--page", str(page)])
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
    assert f"--budget {2 / family.iterations}`" in text


def write_unit(out, family: str, group: str, variant: str, seed: int, metrics: dict) -> None:
    unit = {"family": family, "group": group, "variant": variant, "seed": seed, "device": "cpu: test",
            "settings": {"budget": 1.0, "iterations": 4, "evaluation": {}, "extra": []},
            "value": {"iterations": 4, "optimiser_steps": 4, "curves": {}, "activation_memory_mb": 10.0,
                      "parameters": 5, "metrics": metrics}}
    path = core.unit_path(out, family, group, variant, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(unit))


def test_the_verdict_of_a_higher_is_better_metric_a_single_seed_and_an_unreliable_log_z(tmp_path):
    page = tmp_path / "results.md"
    for seed, (shallow, deq) in enumerate([(-1.0, -0.9), (-1.2, -1.0), (-1.1, -0.8)]):
        write_unit(tmp_path, "dkef", "redwine", "explicit", seed, {"log_likelihood": shallow, "log_z_ess": 500.0})
        write_unit(tmp_path, "dkef", "redwine", "deq", seed, {"log_likelihood": deq, "log_z_ess": 50.0 + seed * 100})
    write_unit(tmp_path, "dkef", "whitewine", "explicit", 0, {"log_likelihood": -2.0})
    write_unit(tmp_path, "dkef", "whitewine", "deq", 0, {"log_likelihood": -2.5})
    write_unit(tmp_path, "dkef", "parkinsons", "explicit", 0, {"log_likelihood": -3.0})
    write_unit(tmp_path, "dkef", "parkinsons", "deq", 0, {"log_likelihood": -2.0})
    study.main(["--report", "--out", str(tmp_path), "--page", str(page)])
    text = page.read_text()
    # redwine: DEQ mean -0.9 against -1.1, higher is better: better by 0.2, the claim holds
    assert "On redwine, the DEQ's test log-lik. (nats / point) is better than the shallow explicit network's by " \
           "0.200 ±" in text and "the claim holds here" in text
    assert "| DKEF on UCI data | redwine | test log-lik. (nats / point) | 3 / 3 | +0.2 ±" in text
    # whitewine: one seed each, worse: not judged
    assert "worse than the shallow explicit network's by 0.500 (a single seed on one side" in text
    row = "| DKEF on UCI data | {} | test log-lik. (nats / point) | 1 / 1 | {} | **cannot be judged** |"
    assert row.format("whitewine", "-0.5") in text
    # parkinsons: one seed each, better, but the noise is unknown: not judged either
    assert row.format("parkinsons", "+1") in text
    # one of the DEQ's three log Z estimates rests on fewer than 100 effective draws
    assert "| redwine | deq | deq | 3 | -0.900 ± 0.058 (1 of 3 with ESS < 100: unreliable) |" in text


def test_the_verdict_follows_the_protocol_rule(tmp_path):
    """The DEQ against the shallow net, judged from hand-made unit files: better, within one standard error of the
    difference, and worse by more."""
    family = FAMILIES["nice"]

    def write(variant: str, values: list[float]) -> None:
        for seed, v in enumerate(values):
            write_unit(tmp_path, "nice", "mnist", variant, seed, {"bits_per_dim": v})

    page = tmp_path / "results.md"
    write("explicit", [5.0, 5.2, 5.4])  # mean 5.2, standard error 0.1155
    for deq, expected in (([5.0, 5.1, 5.2], "better than the shallow explicit network's by 0.100 ± 0.129"),
                          ([5.2, 5.3, 5.4], "worse than the shallow explicit network's by 0.100 ± 0.129"),
                          ([5.3, 5.4, 5.5], "worse than the shallow explicit network's by 0.200 ± 0.129")):
        write("deq", deq)
        study.main(["--report", "--out", str(tmp_path), "--page", str(page)])
        text = page.read_text()
        assert expected in text, text
        holds = deq[1] <= 5.2 + math.hypot(0.2 / math.sqrt(3), 0.1 / math.sqrt(3))
        assert ("the claim holds here" in text) == holds and ("does not hold" in text) == (not holds)
        word = "holds" if holds else "does not hold"
        gap = -(sum(deq) / 3 - 5.2)  # lower bits/dim is better
        assert f"| NICE on MNIST | mnist | test bits/dim | 3 / 3 | {gap:+.3g} ± 0.13 | **{word}** |" in text
    assert family.metrics[0].label in text
    assert f"* **context (not comparable)**: {family.context}" in text  # NICE quotes a published figure


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
])
def test_usage_errors_name_the_option_and_the_choices(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit):
        study.main([*args, "--out", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_the_untrained_network_tells_whether_the_variants_learnt_something(tmp_path):
    """NCSN's best trained variant against the untrained network: more than three standard errors apart, or not;
    said also when the DEQ has no run yet."""
    page = tmp_path / "results.md"

    def write(variant: str, values: list[float]) -> None:
        for seed, v in enumerate(values):
            write_unit(tmp_path, "ncsn", "mnist", variant, seed, {"kid": v})

    write("untrained", [0.50, 0.52, 0.54])  # mean 0.52, standard error 0.0115
    write("explicit", [0.40, 0.42, 0.44])  # 0.10 better: 6 standard errors of the difference (0.0163)
    study.main(["--report", "--out", str(tmp_path), "--page", str(page)])
    text = page.read_text()
    assert "mnist: not enough runs recorded to compare the DEQ" in text
    assert "The best trained variant (explicit, 0.420 ± 0.012) against the untrained network (0.520 ± 0.012): " \
           "better by more than three standard errors: the variants learnt something measurable" in text
    write("explicit", [0.46, 0.48, 0.50])  # 0.04 better: 2.4 standard errors, still noise
    write("deq", [0.47, 0.49, 0.51])
    study.main(["--report", "--out", str(tmp_path), "--page", str(page)])
    text = page.read_text()
    assert "The best trained variant (explicit, 0.480 ± 0.012) against the untrained network (0.520 ± 0.012): " \
           "not clearly better, so this comparison is between networks that are still noise" in text
    # the DEQ is within one standard error, but between networks that are still noise that is no verdict
    assert "the claim cannot be judged here" in text and "**cannot be judged: still noise**" in text


@pytest.mark.parametrize("weights, raw", [("trained", True), ("averaged", False)])
def test_ncsn_samples_from_the_weights_its_evaluation_names(tmp_path, monkeypatch, weights, raw):
    """At the study's budgets the EMA average is still mostly the initial weights: ``weights=trained`` (the default)
    must reach ``sample.py`` as ``--raw-weights``."""
    from deqscore.bench.study import families

    passed = []

    def draw(checkpoint, out, n, seed, options=()):
        passed.extend(options)
        out.mkdir(parents=True)
        (out / "fid.json").write_text(json.dumps({"kid": 0.1, "kid_std": 0.01, "kid_subset_size": 4, "fid": 9.0,
                                                  "num_samples": n, "reference": "r"}))

    monkeypatch.setattr(families, "draw_samples", draw)
    run = tmp_path / "runs" / "ncsn" / "mnist" / "deq_s0"
    evaluation = families.NCSN.evaluation | {"weights": weights}
    families.evaluate_ncsn(run, run / "last.ckpt", families.NCSN.variants["deq"], 0, evaluation)
    assert ("--raw-weights" in passed) == raw
    assert families.NCSN.evaluation["weights"] == "trained"
