"""Build a module from its config, and load any deqscore checkpoint (the model family is read from it).

A module's hyper-parameters are its config (``class_path``/``init_args`` for the network and losses), so a
checkpoint alone rebuilds it.

>>> module = build_module({
...     "class_path": "deqscore.lightning.NICEModule",
...     "init_args": {"net": {"class_path": "deqscore.models.NICE",
...                           "init_args": {"dim": 4, "n_couplings": 2, "hidden": 8, "n_layers": 3}},
...                   "loss": "ssm_vr"}})
>>> type(module.net).__name__, module.loss
('NICE', SSMVR(n_projections=1, projection='rademacher'))
>>> # module = load_module("checkpoints/demo/checkpoints/last.ckpt")   # the NICEModule (or other family)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EMAWeightAveraging as LightningEMA
from pytorch_lightning.cli import instantiate_module
from pytorch_lightning.trainer.states import TrainerFn

from ..errors import ConfigError
from ..privates import CLASS_PATH_KEY, INSTANTIATOR_KEY, recording_hyperparameters
from .base import FAMILY_KEY, CheckpointFamilyError, ScoreModule, family_registry

# where Lightning's weight averaging keeps the trained (not averaged) weights in a checkpoint
RAW_WEIGHTS_KEY = "current_model_state"
# the instantiator Lightning records next to CLI-built hyper-parameters (and trusts when loading)
_INSTANTIATOR = "pytorch_lightning.cli.instantiate_module"


class TrainedWeights(pl.Callback):
    """Test or validate a checkpoint's trained weights instead of their average: a run with weight averaging (EMA)
    stores the average as the checkpoint's ``state_dict``, which ``train.py test`` would score, and the trained
    weights beside it. Short runs want these: an EMA whose span is a large part of the training lags behind it
    (``--trainer.callbacks+=deqscore.lightning.TrainedWeights``; ``sample.py --raw-weights`` alike)."""

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if trainer.state.fn != TrainerFn.FITTING:  # fit resumes its own way
            pl_module.load_state_dict(trained_weights(checkpoint, trainer.ckpt_path))


def trained_weights(checkpoint: dict, path: str | Path | None) -> dict[str, torch.Tensor]:
    """The trained weights ``checkpoint`` (read from ``path``) keeps beside their average, or its only weights where
    it averaged none. A checkpoint whose trained weights equal an average of more than one step's weights was saved
    after fit by Lightning's own averaging callback, which had put the average in their place: a
    :class:`~deqscore.errors.ConfigError`, never the average under the trained weights' name."""
    trained = checkpoint.get(RAW_WEIGHTS_KEY)
    if trained is None:
        return checkpoint["state_dict"]
    averaged = checkpoint.get("averaging_state", {}).get("n_averaged")
    if averaged is not None and int(averaged) > 1 and \
            all(torch.equal(value, checkpoint["state_dict"][name]) for name, value in trained.items()):
        raise ConfigError(f"{path} keeps no trained weights: it was saved after fit by Lightning's weight averaging, "
                          "which puts the average in their place; score its average (no raw weights), or train with "
                          "deqscore.lightning.EMAWeightAveraging, whose checkpoints keep them")
    return trained


class EMAWeightAveraging(LightningEMA):
    """Lightning's EMA of the weights, whose checkpoints keep the trained weights beside their average also when
    saved after fit (``trainer.save_checkpoint`` once ``fit`` returns). Lightning's own callback copies the average
    into the module when training ends, so such a checkpoint holds the average twice and its trained weights
    (``sample.py --raw-weights``, :class:`TrainedWeights`) are lost; this one keeps a copy of them from that moment
    and writes it as the checkpoint's trained weights. Checkpoints saved during training are Lightning's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trained: dict[str, torch.Tensor] | None = None  # the trained weights once training has ended

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trained = None  # a new fit's checkpoints are Lightning's until it ends
        super().setup(trainer, pl_module, stage)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trained = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}
        super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._trained is not None and RAW_WEIGHTS_KEY in checkpoint:
            checkpoint[RAW_WEIGHTS_KEY] = self._trained


def _instantiate(hparams: dict[str, Any]) -> ScoreModule:
    """Build the module described by flat hyper-parameters ``{"_class_path": ..., **init_args}``, recording them
    as its hyper-parameters (as LightningCLI does), so that its own checkpoints rebuild it again."""
    hparams = {k: v for k, v in hparams.items() if k != INSTANTIATOR_KEY}
    with recording_hyperparameters(dict(hparams), _INSTANTIATOR):
        try:
            return instantiate_module(ScoreModule, hparams)
        except Exception as err:  # jsonargparse wraps the constructor's error; keep its message
            cause = err.__cause__ if isinstance(err.__cause__, ConfigError) else err
            raise ConfigError(f"cannot build {hparams.get(CLASS_PATH_KEY)}: {cause}") from err


def build_module(config: dict[str, Any]) -> ScoreModule:
    """The module of a ``{"class_path": ..., "init_args": {...}}`` config (the ``model:`` entry of a run)."""
    if "class_path" not in config:
        raise ConfigError(f"a module config needs a class_path; got keys {sorted(config)}")
    return _instantiate({CLASS_PATH_KEY: config["class_path"], **config.get("init_args", {})})


def read_checkpoint(path: str | Path, map_location: str = "cpu") -> dict[str, Any]:
    """The checkpoint dict in ``path``, checked to be a deqscore checkpoint of a known family."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # truncated or foreign files
        raise CheckpointFamilyError(f"{path} is not a readable PyTorch checkpoint: {err}") from err
    found = ckpt.get(FAMILY_KEY) if isinstance(ckpt, dict) else None
    registry = family_registry()
    if found not in registry:
        raise CheckpointFamilyError(
            f"{path} is not a deqscore checkpoint (model family {found!r}; known: {sorted(registry)})"
        )
    return ckpt


def load_module(path: str | Path, family: str | None = None, map_location: str = "cpu",
                raw_weights: bool = False) -> ScoreModule:
    """Rebuild the LightningModule stored in ``path``; with ``family`` given, a checkpoint of another family
    raises :class:`CheckpointFamilyError`. A run with weight averaging (EMA) stores the averaged weights as the
    checkpoint's ``state_dict``, which is what is loaded; ``raw_weights=True`` loads the trained weights kept
    beside them instead (the same weights for a run without averaging)."""
    ckpt = read_checkpoint(path, map_location)
    found = ckpt[FAMILY_KEY]
    if family is not None and found != family:
        raise CheckpointFamilyError(f"{path} holds a {found!r} model, expected {family!r}")
    hparams = dict(ckpt.get("hyper_parameters") or {})
    if CLASS_PATH_KEY not in hparams:
        raise CheckpointFamilyError(
            f"{path} does not record the module's config (it was built in Python from objects); build modules "
            "with train.py or deqscore.lightning.build_module to get checkpoints that rebuild them"
        )
    module = _instantiate(hparams)
    module.on_load_checkpoint(ckpt)
    module.load_state_dict(trained_weights(ckpt, path) if raw_weights else ckpt["state_dict"])
    return module.to(map_location)
