"""An invalid option that a data module's or a family module's constructor refuses is one usage line naming the
option, with status 2 and no traceback, for every data module and every family (the constructors raise while
LightningCLI instantiates the config, where jsonargparse would report them inside a traceback)."""

import pytest

from deqscore.cli.train import run

from .conftest import ROOT, tiny_args

NICE = ROOT / "configs" / "nice" / "deq.yaml"
CASES = [  # (config, arguments, the option the line must name, a phrase of the constructor's message)
    (NICE, ["--data.init_args.val_fraction", "1.5"], "--data.init_args.val_fraction", "must lie in [0, 1)"),
    (NICE, ["--data.init_args.batch_size", "0"], "--data.init_args.batch_size", "must be positive"),
    (NICE, ["--data", "deqscore.data.CIFAR10DataModule", "--data.init_args.val_fraction", "-0.5"],
     "--data.init_args.val_fraction", "must lie in [0, 1)"),
    (NICE, ["--data", "deqscore.data.CelebADataModule", "--data.init_args.num_workers", "-1"],
     "--data.init_args.num_workers", "must be >= 0"),
    (NICE, ["--data", "deqscore.data.ImageFolderDataModule", "--data.init_args.data_dir", "{empty}"],
     "--data.init_args.data_dir", "holds no image for the train split"),
    (ROOT / "configs" / "dkef" / "deq.yaml", ["--data.init_args.noise_std", "-1"], "--data.init_args.noise_std",
     "must be >= 0"),
    (NICE, ["--model.init_args.exact_sm_samples", "0"], "--model.init_args.exact_sm_samples", "must be >= 1"),
    (ROOT / "configs" / "dkef" / "deq.yaml", ["--model.init_args.final_lambda_steps", "-1"],
     "--model.init_args.final_lambda_steps", "final_lambda_steps"),
    (ROOT / "configs" / "vae" / "deq_mnist.yaml", ["--model.init_args.ais_steps", "0"],
     "--model.init_args.ais_steps", "ais_steps"),
    (ROOT / "configs" / "ncsn" / "deq_mnist.yaml", ["--model.init_args.n_levels", "1"],
     "--model.init_args.n_levels", "n_levels"),
]


@pytest.mark.parametrize("config, args, option, phrase", CASES, ids=[c[2].split(".")[-1] + "-" + c[0].parent.name
                                                                    + ("-" + c[1][1] if c[1][0] == "--data" else "")
                                                                    for c in CASES])
def test_an_invalid_option_refused_by_a_constructor_is_one_line(tmp_path, capsys, config, args, option, phrase):
    (tmp_path / "empty").mkdir()
    args = [a.format(empty=tmp_path / "empty") for a in args]
    assert run(["fit", "--config", str(config), "--runs_root", str(tmp_path / "runs"), *args]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error: " in line]  # "<program>: error: ..."
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].split(": error: ", 1)[1].startswith(f"{option}: ") and phrase in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()  # nothing written


def test_a_checkpoint_of_another_family_names_both_families_first(tmp_path, capsys):
    """A NICE checkpoint given to ``train.py test`` with a DKEF config: one line that says so, not a diff of options."""
    assert run(["fit", *tiny_args(tmp_path, "configs/nice/explicit.yaml", "nice"), "--trainer.max_steps", "1"]) == 0
    capsys.readouterr()
    ckpt = tmp_path / "nice" / "checkpoints" / "last.ckpt"
    assert run(["test", *tiny_args(tmp_path, "configs/dkef/deq.yaml", "dkef"), "--ckpt_path", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert f"ckpt_path: {ckpt} holds a 'nice' model, but the config describes a 'dkef' model" in err
    assert "Traceback" not in err and err.count(": error: ") == 1
