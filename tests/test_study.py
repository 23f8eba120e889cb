"""The reduced-budget NICE study on tiny settings: its table reports what the runs logged."""

import json

import pytest

from deqscore.bench import study
from deqscore.lightning.callbacks import read_metrics_csv

TINY = [
    "--model.init_args.net.init_args.hidden=12", "--model.init_args.net.init_args.n_layers=3",
    "--model.init_args.net.init_args.n_couplings=2", "--model.init_args.exact_sm_samples=4",
    "--data.init_args.batch_size=16", "--data.init_args.eval_batch_size=16", "--data.init_args.train_subset=32",
    "--data.init_args.val_subset=16", "--data.init_args.test_subset=16", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1",
]


def test_study_table_matches_the_runs_and_recorded_units_are_not_run_again(tmp_path, monkeypatch):
    args = ["--epochs", "1", "--variants", "explicit_ssm,deq_ssm", "--seeds", "0,1", "--runs-root",
            str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--extra", *TINY]
    rows = study.main(args)
    doc = json.loads((tmp_path / "out" / "nice_study.json").read_text())
    expected = [("explicit_ssm", 0), ("explicit_ssm", 1), ("deq_ssm", 0), ("deq_ssm", 1)]
    assert [(r["variant"], r["seed"]) for r in doc["rows"]] == expected == [(r["variant"], r["seed"]) for r in rows]
    md = (tmp_path / "out" / "nice_study.md").read_text()
    for row in rows:
        assert f"| {row['variant']} | {row['seed']} | 1 (2) |" in md
        series = read_metrics_csv(tmp_path / "runs" / f"{row['variant']}_s{row['seed']}" / "metrics.csv")
        for key in ("log_likelihood", "bits_per_dim", "exact_sm"):
            assert row[key] == pytest.approx(series[f"test/{key}"][-1][1])
        assert row["parameters"] == series["run/parameters"][-1][1]
    # the seed reaches the run: different initial weights, different test figures
    assert rows[0]["log_likelihood"] != rows[1]["log_likelihood"]
    # the summary: mean and standard error over the seeds, from the rows
    summary = {s["variant"]: s for s in doc["summary"]}
    a, b = (r["bits_per_dim"] for r in rows[:2])
    assert summary["explicit_ssm"]["bits_per_dim"]["mean"] == pytest.approx((a + b) / 2)
    assert summary["explicit_ssm"]["bits_per_dim"]["stderr"] == pytest.approx(abs(a - b) / 2)
    # the DEQ m-net has two hidden 12x12 layers where the 3-layer explicit one has one
    assert rows[2]["parameters"] - rows[0]["parameters"] == 2 * (12 * 12 + 12)
    # a second call reads every unit back: nothing is trained again
    monkeypatch.setattr(study, "run_variant", lambda *a, **k: pytest.fail("a recorded unit was run again"))
    assert study.main(args) == rows


def test_unknown_variant_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        study.main(["--variants", "deq_nce", "--out", str(tmp_path)])
    assert "unknown variants ['deq_nce']" in capsys.readouterr().err


def test_ncsn_study_reports_what_its_runs_logged_and_scored(tmp_path):
    from deqscore.bench import ncsn_study

    rows = ncsn_study.main([
        "--steps", "2", "--ngf", "4", "--batch", "16", "--langevin-steps", "1", "--samples", "4", "--sample-batch", "4",
        "--reference", "6", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
        "--stats-root", str(tmp_path / "stats"), "--extra", "--data.init_args.train_subset=48",
        "--data.init_args.val_subset=16", "--data.init_args.eval_batch_size=16"])
    assert [r["variant"] for r in rows] == ["deq", "explicit"]
    for row in rows:
        run = tmp_path / "runs" / f"ncsn_{row['variant']}"
        report = json.loads((run / "samples" / "fid.json").read_text())
        series = read_metrics_csv(run / "metrics.csv")
        assert row["steps"] == 2 and row["fid"] == report["fid"] > 0 and row["fid_samples"] == 4
        assert row["parameters"] == series["run/parameters"][-1][1]
        assert row["val_loss"] == pytest.approx(series["val/loss"][-1][1])
    md = (tmp_path / "out" / "ncsn_mnist_study.md").read_text()
    assert "mnist train (6 images)" in md and f"{rows[0]['fid']:.2f}" in md
