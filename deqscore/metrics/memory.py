"""Activation memory: bytes of tensors autograd saves for backward, parameters excluded.

>>> import torch
>>> lin = torch.nn.Linear(10, 10)
>>> with SavedTensorMeter(exclude=lin.parameters()) as meter:
...     y = torch.tanh(lin(torch.randn(4, 10))).sum()
>>> meter.bytes  # the input of the matmul (4x10) and tanh's output (4x10), float32
320
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _storage_key(t: torch.Tensor) -> tuple:
    try:
        return (t.untyped_storage().data_ptr(), t.device)
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. functorch wrappers)
        return (id(t), t.device)


class SavedTensorMeter:
    """Context manager summing the distinct storages autograd saves while active.

    Each storage is counted once (a tensor saved by several nodes is one allocation); storages of the
    tensors in ``exclude`` (the parameters) are not counted, since they exist whether or not autograd records.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {_storage_key(p) for p in exclude}
        self._seen: dict[tuple, int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self._excluded and key not in self._seen:
            try:
                self._seen[key] = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                self._seen[key] = t.numel() * t.element_size()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> SavedTensorMeter:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def parameter_count(module: torch.nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameters."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
