"""Finiteness checks that raise at once (the default) or, inside :func:`deferred_checks`, fold into one device flag.

On a GPU every ``if not torch.isfinite(x).all()`` is a host synchronisation. A training step that checks its
input, its loss and its gradients would wait for the device three times; under :func:`deferred_checks` each check
only adds a boolean tensor to a :class:`DeferredChecks`, and the caller reads all of them with one sync
(:meth:`DeferredChecks.read`) before the update.

>>> import torch
>>> require_finite(torch.ones(2), lambda n: ValueError(f"{n} bad"))  # default: checked (and raised) now
>>> checks = DeferredChecks()
>>> with deferred_checks(checks):
...     require_finite(torch.tensor([1.0, float("nan")]), lambda n: ValueError(f"{n} bad"), what="input")
>>> checks.read()  # one sync for every check of the step: the names of those that failed
['input']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_ACTIVE: list[DeferredChecks] = []


class DeferredChecks:
    """Boolean device tensors (True: finite) collected under names, read together with :meth:`read`."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.flags: list[torch.Tensor] = []

    def add(self, ok: torch.Tensor, what: str) -> None:
        self.names.append(what)
        self.flags.append(ok.reshape(()).to(torch.bool))

    def __len__(self) -> int:
        return len(self.flags)

    def stacked(self) -> torch.Tensor:
        """The flags as one ``[n]`` tensor (empty when nothing was checked)."""
        return torch.stack(self.flags) if self.flags else torch.ones(0, dtype=torch.bool)

    def read(self) -> list[str]:
        """Names of the failed checks (one host sync); the collection is emptied."""
        failed = [] if not self.flags else [n for n, ok in zip(self.names, self.stacked().tolist(), strict=True)
                                            if not ok]
        self.names, self.flags = [], []
        return failed


@contextmanager
def deferred_checks(checks: DeferredChecks) -> Iterator[DeferredChecks]:
    """Within this block :func:`require_finite` records into ``checks`` instead of raising."""
    _ACTIVE.append(checks)
    try:
        yield checks
    finally:
        _ACTIVE.pop()


def active_checks() -> DeferredChecks | None:
    """The innermost :func:`deferred_checks` collection, or None (checks raise at once)."""
    return _ACTIVE[-1] if _ACTIVE else None


def require_finite(x: torch.Tensor, error: Callable[[int], Exception], what: str = "tensor") -> None:
    """Raise ``error(number of non-finite values)`` if ``x`` holds a NaN/Inf; inside :func:`deferred_checks`
    record the check under ``what`` instead (no host sync)."""
    ok = torch.isfinite(x).all()
    checks = active_checks()
    if checks is not None:
        checks.add(ok, what)
        return
    if not ok:  # one host sync; the count only on failure
        raise error(int((~torch.isfinite(x)).sum()))
