"""Which backward modes a model may use (:func:`require_backward`, the one place that decides it), switching
them for an evaluation (:func:`deq_backward`), and the exact parameter gradient a trained DEQ's own is measured
against (:func:`exact_gradients`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import ConfigError
from .layer import DEQ, MAX_DERIVATIVE_ORDER, check_backward


def require_backward(module: nn.Module, order: int, user: str) -> None:
    """Raise :class:`~deqscore.errors.ConfigError` if a DEQ layer inside ``module`` uses a backward mode that
    cannot give derivatives of ``order`` through it (1: a parameter gradient; 2: a parameter gradient of an input
    derivative, as every score-matching loss of an energy takes). ``user`` names what asks (a loss, a model).

    >>> from torch import nn
    >>> class Map(nn.Module):
    ...     def forward(self, z, u):
    ...         return 0.5 * z + u
    >>> require_backward(DEQ(Map(), backward="ift"), order=1, user="loss 'dsm'")  # first order: fine
    >>> require_backward(DEQ(Map(), backward="ift"), order=2, user="loss 'ssm'")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    deqscore.errors.ConfigError: DEQ backward='ift' cannot be used with loss 'ssm': ... 'phantom', 'unroll', 'implicit'
    """
    for layer in module.modules():
        if not isinstance(layer, DEQ):
            continue
        limit = MAX_DERIVATIVE_ORDER[layer.backward]
        if limit is not None and order > limit:
            accepted = ", ".join(repr(m) for m, cap in MAX_DERIVATIVE_ORDER.items() if cap is None or cap >= order)
            raise ConfigError(
                f"DEQ backward={layer.backward!r} cannot be used with {user}: it differentiates through the DEQ "
                f"{order} times, {layer.backward!r} gives correct derivatives of order {limit} only "
                f"(docs/method.md section 2.5); accepted backward: {accepted}"
            )


@contextmanager
def deq_backward(module: nn.Module, backward: str) -> Iterator[None]:
    """Temporarily set the backward mode of every DEQ layer inside ``module`` (e.g. ``"unroll"``, for the exact
    derivatives of the converged layer in a second-order metric of a model trained with ``backward="ift"``)."""
    check_backward(backward)
    layers = [m for m in module.modules() if isinstance(m, DEQ)]
    saved = [m.backward for m in layers]
    for m in layers:
        m.backward = backward
    try:
        yield
    finally:
        for m, mode in zip(layers, saved, strict=True):
            m.backward = mode


def exact_gradients(module: nn.Module, objective: Callable[[], torch.Tensor],
                    params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """``objective()`` and its gradient in ``params`` with every DEQ layer of ``module`` switched to
    ``backward="implicit"``: the derivatives of the exact fixed point, at any order, at the memory of a few map
    evaluations (docs/method.md 2.9). The reference against which a phantom gradient's error is measured; make
    ``objective`` draw the same random numbers at each call (seed inside it) to compare it with another mode."""
    with deq_backward(module, "implicit"), torch.enable_grad():
        value = objective()
        grads = torch.autograd.grad(value, list(params), allow_unused=True)
    return value.detach(), grads
