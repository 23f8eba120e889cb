"""Evaluation helpers: activation-memory measurement and parameter counts."""

from .memory import SavedTensorMeter, parameter_count

__all__ = ["SavedTensorMeter", "parameter_count"]
