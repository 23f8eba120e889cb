"""Lightning layer: one LightningModule per model family around a plain network, callbacks and the CLI."""

from .base import CheckpointFamilyError, NonFiniteLossError, ScoreModule, family_registry
from .callbacks import LearningCurves, SampleGrid
from .checkpoint import build_module, load_module
from .dkef import DKEFModule
from .nice import NICE_LOSSES, NICEModule

__all__ = [
    "NICE_LOSSES",
    "CheckpointFamilyError",
    "DKEFModule",
    "LearningCurves",
    "NICEModule",
    "NonFiniteLossError",
    "SampleGrid",
    "ScoreModule",
    "build_module",
    "family_registry",
    "load_module",
]
