"""A family's closing stage (DKEF's) is a resumable step: a fit resumed after its training is done but without
``final.ckpt`` runs the stage, and an error in the stage leaves the run resumable with the advised option."""

import logging

import torch

from deqscore.cli.train import main, run
from deqscore.errors import ConfigError
from deqscore.lightning.dkef import DKEFModule

from .conftest import tiny_args

SHALLOW = "configs/dkef/explicit_shallow.yaml"


def _fit(tmp_path, *extra):
    return main(["fit", *tiny_args(tmp_path, SHALLOW, "run"), "--trainer.max_epochs", "1",
                 "--model.init_args.final_lambda_steps", "5", *extra])


def _resume(tmp_path, *extra):
    run = tmp_path / "run"
    return main(["fit", "--config", str(run / "config.yaml"), "--ckpt_path", str(run / "checkpoints" / "last.ckpt"),
                 *extra])


def test_a_resume_after_training_runs_a_missing_closing_stage(tmp_path, caplog):
    _fit(tmp_path)
    final = tmp_path / "run" / "checkpoints" / "final.ckpt"
    first = torch.load(final, weights_only=True)["state_dict"]
    final.unlink()  # as if the stage had been killed
    with caplog.at_level(logging.INFO):
        _resume(tmp_path)
    assert "is missing: running the closing stage" in caplog.text
    again = torch.load(final, weights_only=True)["state_dict"]
    assert [k for k, v in first.items() if not torch.equal(v, again[k])] == []  # same stage, same weights
    final_mtime = final.stat().st_mtime_ns
    _resume(tmp_path)  # done and final.ckpt present: nothing to do
    assert final.stat().st_mtime_ns == final_mtime


def test_a_closing_stage_that_fails_can_be_resumed_with_the_advised_option(tmp_path, capsys, monkeypatch):
    tuned = DKEFModule._closing_stage

    def advise_when_too_fast(self, datamodule):  # the stage's own error for a diverging fine-tuning
        if self.final_lambda_lr > 0.1:
            raise ConfigError("log_lambda became non-finite while fine-tuned: lower final_lambda_lr")
        tuned(self, datamodule)

    monkeypatch.setattr(DKEFModule, "_closing_stage", advise_when_too_fast)
    args = ["fit", *tiny_args(tmp_path, SHALLOW, "run"), "--trainer.max_epochs", "1",
            "--model.init_args.final_lambda_steps", "5", "--model.init_args.final_lambda_lr", "1.0"]
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "lower final_lambda_lr" in err and "Traceback" not in err
    final = tmp_path / "run" / "checkpoints" / "final.ckpt"
    assert not final.exists() and (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    _resume(tmp_path, "--model.init_args.final_lambda_lr", "0.01")
    state = torch.load(final, weights_only=True)["state_dict"]
    assert torch.isfinite(state["net.log_lambda"])
