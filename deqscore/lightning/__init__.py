"""Lightning layer: one LightningModule per model family around a plain network, callbacks and the CLI."""

from .base import CheckpointFamilyError, ScoreModule, family_registry
from .callbacks import LearningCurves, SampleGrid
from .checkpoint import EMAWeightAveraging, TrainedWeights, build_module, load_module
from .dkef import DKEFModule
from .fid import FIDCallback
from .ncsn import NCSN_LOSSES, NCSNModule
from .nice import NICE_LOSSES, NICEModule
from .nonfinite import NonFiniteLossError
from .vae import VAEModule

__all__ = [
    "NCSN_LOSSES",
    "NCSNModule",
    "NICE_LOSSES",
    "CheckpointFamilyError",
    "DKEFModule",
    "EMAWeightAveraging",
    "FIDCallback",
    "LearningCurves",
    "NICEModule",
    "NonFiniteLossError",
    "SampleGrid",
    "TrainedWeights",
    "VAEModule",
    "ScoreModule",
    "build_module",
    "family_registry",
    "load_module",
]
