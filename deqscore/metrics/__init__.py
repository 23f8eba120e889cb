"""Evaluation: activation memory and parameter counts; sample quality (FID and KID) by job: the Inception network
and its weights (``inception``), feature statistics (``statistics``), the cache of reference statistics
(``reference``) and the metrics themselves (``quality``); AIS log-likelihoods (``ais``)."""

from .memory import SavedTensorMeter, UnmeasurableStep, parameter_count, step_activation_bytes
from .quality import kernel_inception_distance, sample_quality

__all__ = [
    "SavedTensorMeter",
    "UnmeasurableStep",
    "kernel_inception_distance",
    "parameter_count",
    "sample_quality",
    "step_activation_bytes",
]
