"""Point data in the model's space and in the data's own units: the PCA whitening of the UCI tables
(:class:`Whitening`), kept in checkpoints so that samples are written in the data's units without the data.

>>> import numpy as np
>>> rows = np.random.RandomState(0).standard_normal((500, 3)) @ np.array([[2.0, 0, 0], [1, 1, 0], [0, 0, 5]]) + 7
>>> w = Whitening.fit(rows)
>>> x = w.to_model(rows)
>>> bool(np.allclose(x.mean(0), 0) and np.allclose(np.cov(x, rowvar=False, bias=True), np.eye(3)))
True
>>> bool(np.allclose(w.to_data(x), rows))
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def fit_whitening(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(mean [D], matrix [D, D])`` such that ``(data - mean) @ matrix`` has mean 0 and covariance I
    (normalised by N): PCA rotation and scaling, ``matrix = V / s * sqrt(N)`` from ``data - mean = U S V^T``."""
    mean = data.mean(axis=0)
    _, s, vt = np.linalg.svd(data - mean, full_matrices=False)
    if s.size < data.shape[1] or s[-1] <= s[0] * 1e-10:
        raise ValueError(f"cannot whiten: the {data.shape[0]} x {data.shape[1]} data have a singular covariance")
    return mean, vt.T / s * math.sqrt(data.shape[0])


class Whitening:
    """``x = (row - mean) @ matrix`` (model space) and its inverse ``row = x @ matrix^-1 + mean`` (the data's
    units), with the names of the data's columns; plain enough to be stored in a checkpoint (:meth:`as_dict`)."""

    def __init__(self, mean: Sequence[float] | np.ndarray, matrix: Sequence[Sequence[float]] | np.ndarray,
                 columns: Sequence[str] = ()) -> None:
        self.mean = np.asarray(mean, dtype=np.float64)
        self.matrix = np.asarray(matrix, dtype=np.float64)
        dim = self.mean.shape[0] if self.mean.ndim == 1 else -1
        if dim < 1 or self.matrix.shape != (dim, dim) or (columns and len(columns) != dim):
            raise ValueError(f"a whitening needs a mean [D], a matrix [D, D] and D column names (or none); got "
                             f"{self.mean.shape}, {self.matrix.shape} and {len(columns)} names")
        self.columns = tuple(columns)
        self.inverse = np.linalg.inv(self.matrix)

    @classmethod
    def fit(cls, data: np.ndarray, columns: Sequence[str] = ()) -> Whitening:
        """The whitening of ``data [N, D]`` (:func:`fit_whitening`)."""
        return cls(*fit_whitening(data), columns)

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    @property
    def log_det(self) -> float:
        """``log |det matrix|``: a log-density in model space plus this is one in the data's units."""
        return float(np.linalg.slogdet(self.matrix)[1])

    def to_model(self, rows: np.ndarray) -> np.ndarray:
        return (rows - self.mean) @ self.matrix

    def to_data(self, x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """Model-space points ``[N, D]`` in the data's units (a tensor stays a tensor, on its device and dtype)."""
        if isinstance(x, np.ndarray):
            return x @ self.inverse + self.mean
        inverse, mean = (torch.as_tensor(a, dtype=x.dtype, device=x.device) for a in (self.inverse, self.mean))
        return x @ inverse + mean

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.tolist(), "matrix": self.matrix.tolist(), "columns": list(self.columns)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Whitening:
        return cls(d["mean"], d["matrix"], d.get("columns", ()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Whitening) and other.as_dict() == self.as_dict()

    __hash__ = None  # mutable arrays inside


__all__ = ["Whitening", "fit_whitening"]
