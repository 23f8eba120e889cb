"""DEQ engine: solvers, the DEQ layer and contraction helpers."""

from .layer import BACKWARD_MODES, DEQ, DEQConvergenceWarning, SecondOrderIFTError, deq_backward
from .norm import FrobeniusScale, frobenius_scale, spectral_normalize
from .solvers import (
    NonFiniteIterateError,
    SolverStats,
    available_solvers,
    get_solver,
    register_solver,
)

__all__ = [
    "BACKWARD_MODES",
    "DEQ",
    "DEQConvergenceWarning",
    "FrobeniusScale",
    "NonFiniteIterateError",
    "SecondOrderIFTError",
    "SolverStats",
    "available_solvers",
    "deq_backward",
    "frobenius_scale",
    "get_solver",
    "register_solver",
    "spectral_normalize",
]
