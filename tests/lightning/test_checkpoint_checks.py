"""A checkpoint that does not fit the run is refused with one message: weights trained on data of another
dimension (both dimensions named), optimiser states that do not match the module's optimisers."""

import torch

from deqscore.cli.train import run

from .conftest import tiny_args


def test_a_dkef_checkpoint_resumed_on_data_of_another_dimension_names_both(tmp_path, capsys):
    args = [*tiny_args(tmp_path, "configs/dkef/explicit_shallow.yaml", "red"), "--trainer.max_epochs", "1"]
    assert run(["fit", *args]) == 0
    ckpt = tmp_path / "red" / "checkpoints" / "last.ckpt"
    capsys.readouterr()
    code = run(["test", *args, "--data.init_args.dataset", "parkinsons", "--ckpt_path", str(ckpt)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "network has dim 11, this run's data dim 15" in err, err


def test_a_vae_checkpoint_missing_an_optimiser_state_is_refused(tmp_path, capsys):
    args = [*tiny_args(tmp_path, "configs/vae/explicit_mnist.yaml", "vae"), "--trainer.max_epochs", "1",
            "--trainer.max_steps", "-1", "--model.init_args.ais_batches", "0"]
    assert run(["fit", *args]) == 0
    ckpt = tmp_path / "vae" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=False)
    assert len(state["optimizer_states"]) == 2
    state["optimizer_states"] = state["optimizer_states"][:1]
    torch.save(state, tmp_path / "one.ckpt")
    capsys.readouterr()
    code = run(["fit", "--config", str(tmp_path / "vae" / "config.yaml"), "--trainer.max_epochs", "2",
                "--ckpt_path", str(tmp_path / "one.ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and "holds 1 optimiser state(s), this VAEModule has 2 optimiser(s)" in err, err
