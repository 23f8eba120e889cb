"""The private parts of Lightning that deqscore relies on, each checked here so that a Lightning release that changes
one fails this file (and names the place) rather than breaking a run silently. Where a public API exists the code
uses it; these have none in Lightning 2.6."""

import inspect

import pytorch_lightning.cli as lightning_cli
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop
from pytorch_lightning.strategies import DDPStrategy


def test_ddp_strategy_takes_its_process_group_timeout_from_timeout_attribute():
    """cli/train.py sets ``strategy._timeout`` (--process_group_timeout) before the process group is made."""
    from datetime import timedelta

    assert DDPStrategy(timeout=timedelta(seconds=7))._timeout == timedelta(seconds=7)
    assert '{"timeout": self._timeout}' in inspect.getsource(DDPStrategy).replace("'", '"')


def test_ddp_strategy_keeps_its_ddp_options_in_ddp_kwargs():
    """lightning/vae.py reads ``strategy._ddp_kwargs["find_unused_parameters"]`` to refuse plain DDP."""
    assert DDPStrategy(find_unused_parameters=True)._ddp_kwargs["find_unused_parameters"] is True


def test_the_epoch_loop_counts_optimizer_stepping_batches_as_batches_that_stepped():
    """run_hooks.py logs at, and runs.py reads from checkpoints, the loop's ``_batches_that_stepped``."""
    source = inspect.getsource(_TrainingEpochLoop)
    assert "self._batches_that_stepped" in source and '"_batches_that_stepped"' in source.replace("'", '"')


def test_lightning_cli_runs_its_subcommand_through_the_methods_deqscore_overrides():
    """cli/train.py overrides ``_run_subcommand``, ``_parse_ckpt_path`` and
    ``_add_configure_optimizers_method_to_model``; each must still be called by LightningCLI itself."""
    source = inspect.getsource(LightningCLI)
    for name in ("_run_subcommand", "_parse_ckpt_path", "_add_configure_optimizers_method_to_model"):
        assert callable(getattr(LightningCLI, name)) and f"self.{name}(" in source, name


def test_lightning_cli_saves_hyperparameters_with_class_path_and_instantiator_keys():
    """lightning/checkpoint.py and cli/checkpoints.py read a checkpoint's ``_class_path`` and drop its
    ``_instantiator``: the keys LightningCLI's instantiation writes."""
    source = inspect.getsource(lightning_cli)
    assert '"_class_path"' in source.replace("'", '"') and '"_instantiator"' in source.replace("'", '"')
