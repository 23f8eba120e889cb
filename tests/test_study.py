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
