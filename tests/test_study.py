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


def test_study_table_matches_the_runs(tmp_path):
    rows = study.main(["--epochs", "1", "--variants", "explicit_ssm,deq_ssm", "--runs-root", str(tmp_path / "runs"),
                       "--out", str(tmp_path / "out"), "--extra", *TINY])
    doc = json.loads((tmp_path / "out" / "nice_study.json").read_text())
    assert [r["variant"] for r in doc["rows"]] == ["explicit_ssm", "deq_ssm"] == [r["variant"] for r in rows]
    md = (tmp_path / "out" / "nice_study.md").read_text()
    for row in rows:
        assert f"| {row['variant']} | 1 (2) |" in md
        series = read_metrics_csv(tmp_path / "runs" / row["variant"] / "metrics.csv")
        for key in ("log_likelihood", "bits_per_dim", "exact_sm"):
            assert row[key] == pytest.approx(series[f"test/{key}"][-1][1])
        assert row["parameters"] == series["run/parameters"][-1][1]
    # the DEQ m-net has two hidden 12x12 layers where the 3-layer explicit one has one
    assert rows[1]["parameters"] - rows[0]["parameters"] == 2 * (12 * 12 + 12)


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
