"""Infinite-width kernels of DEQs: the DEQ-NNGP and DEQ-NTK (exact or with K phantom steps), the finite-depth
recursions they are the limit of, and a finite weight-tied DEQ with its empirical tangent kernel to check them.

>>> import torch
>>> X = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64), dim=1)
>>> deq_ntk(X, X, sw2=0.5, su2=0.3, sb2=0.2).diagonal().tolist()
[3.0, 3.0]
>>> deq_nngp(X, X, sw2=0.5, su2=0.3, sb2=0.2).dtype
torch.float64

The formulas and the conditions under which a finite DEQ approaches them are in ``docs/method.md`` (section
"Infinite-width kernels"); ``python -m deqlab kernels`` uses them for kernel regression on MNIST.
"""

from .arccos import check_variances, k0, k1, unit_rows
from .depth import finite_depth_kernels, finite_depth_nngp, finite_depth_ntk, normalised
from .deq import deq_nngp, deq_ntk, fixed_point_correlation, ntk_diagonal
from .empirical import FiniteDEQ, empirical_nngp, empirical_ntk

__all__ = [
    "FiniteDEQ",
    "check_variances",
    "deq_nngp",
    "deq_ntk",
    "empirical_nngp",
    "empirical_ntk",
    "finite_depth_kernels",
    "finite_depth_nngp",
    "finite_depth_ntk",
    "fixed_point_correlation",
    "k0",
    "k1",
    "normalised",
    "ntk_diagonal",
    "unit_rows",
]
