"""DEQ engine: solvers, the DEQ layer and contraction helpers."""

from .backward import deq_backward, exact_gradients, require_backward
from .layer import (
    BACKWARD_MODES,
    DEQ,
    DEQConvergenceWarning,
    DEQFactory,
    SecondOrderIFTError,
    restore_warm_starts,
    set_aside_warm_starts,
)
from .norm import FrobeniusScale, SpectralCap, frobenius_scale, spectral_cap, spectral_normalize
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
    "DEQFactory",
    "FrobeniusScale",
    "NonFiniteIterateError",
    "SecondOrderIFTError",
    "SolverStats",
    "SpectralCap",
    "available_solvers",
    "deq_backward",
    "exact_gradients",
    "frobenius_scale",
    "get_solver",
    "register_solver",
    "require_backward",
    "restore_warm_starts",
    "set_aside_warm_starts",
    "spectral_cap",
    "spectral_normalize",
]
