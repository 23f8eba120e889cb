"""Activation memory: bytes of the tensors autograd saves for backward during one training step (forward and
backward), parameters excluded. One meter serves the benchmark and the figure a training run logs.

The meter reads the saved tensors of every autograd node created while it is active (a node-creation hook, torch
2.14 on), not through saved-tensor hooks: ``torch.func`` refuses to run under those, and the exact DEQ backward
(``backward="implicit"``) takes its partial derivatives with ``torch.func.vjp``. An older torch has no such hook;
there the meter packs saved tensors through saved-tensor hooks, which see the same tensors of an ordinary step, and
a step of the exact backward cannot be measured (``torch.func`` says so). What a ``torch.func`` transform
records at its own inner level (tensors wrapped by it) lives only inside that call and is not counted: it is
working memory, like a solver's history, not part of the step's graph.

>>> import torch
>>> lin = torch.nn.Linear(10, 10)
>>> with SavedTensorMeter(exclude=lin.parameters()) as meter:
...     y = torch.tanh(lin(torch.randn(4, 10))).sum()
>>> meter.bytes  # the input of the matmul (4x10) and tanh's output (4x10), float32
320
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._C._functorch import is_functorch_wrapped_tensor

from ..deq import restore_warm_starts, set_aside_warm_starts


def _storage_key(t: torch.Tensor) -> tuple:
    try:
        return (t.untyped_storage().data_ptr(), t.device)
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. functorch wrappers)
        return (id(t), t.device)


def _saved_tensors(node: torch.autograd.graph.Node) -> list[torch.Tensor]:
    """The tensors ``node`` saved for its backward (a built-in node's ``_saved_*`` fields, a custom Function's
    ``saved_tensors``), those wrapped by a ``torch.func`` transform left out."""
    found: list = []
    for name in dir(node):
        if name.startswith("_saved_") or name == "saved_tensors":
            try:
                value = getattr(node, name)
            except RuntimeError:  # already released
                continue
            found.extend(value if isinstance(value, (list, tuple)) else [value])
    return [t for t in found if isinstance(t, torch.Tensor) and not is_functorch_wrapped_tensor(t)
            and not _lone_scalar(t)]


def _lone_scalar(t: torch.Tensor) -> bool:
    """A 0-d tensor with a storage of its own. An operation with a Python number (``y * 3``) saves the number as
    one: no activation (saved-tensor hooks never saw one), and not to be told apart from a genuine 0-d tensor, which
    is left out with it (a few bytes)."""
    return t.dim() == 0 and _storage_nbytes(t) <= t.element_size()


def _storage_nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without storage: their own elements
        return t.numel() * t.element_size()


class UnmeasurableStep(RuntimeError):
    """A step this torch's meter cannot measure: one that runs ``torch.func`` transforms, before torch 2.14."""


def measures_func_transforms() -> bool:
    """Whether this torch lets the meter measure a step that runs ``torch.func`` transforms (the exact DEQ
    backward's): it has the node-creation hook (2.14 on)."""
    return hasattr(torch.autograd.graph, "node_creation_hook")


class SavedTensorMeter:
    """Context manager summing the distinct storages autograd saves while active, each once, those of ``exclude``
    (the parameters) left out. Storages are told apart by address, so every saved tensor is kept alive until exit:
    a storage freed during the step would otherwise hand its address to a later one, which would go uncounted."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {_storage_key(p) for p in exclude}
        self._seen: dict[tuple, int] = {}
        self._pinned: list[torch.Tensor] = []
        if measures_func_transforms():
            self._ctx = torch.autograd.graph.node_creation_hook(self._node)
        else:  # torch before 2.14 (module docstring)
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _node(self, node: torch.autograd.graph.Node) -> None:
        for t in _saved_tensors(node):
            self._count(t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _lone_scalar(t):
            self._count(t)
        return t

    def _count(self, t: torch.Tensor) -> None:
        self._pinned.append(t)
        key = _storage_key(t)
        if key not in self._excluded and key not in self._seen:
            self._seen[key] = _storage_nbytes(t)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> SavedTensorMeter:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
        self._pinned.clear()


def step_activation_bytes(step: Callable[[], Any], module: torch.nn.Module) -> int:
    """Bytes saved for backward by ``step()`` (a training step's forward and backward) of ``module``'s
    parameters excluded, leaving no trace: the RNG is forked, buffers (batch-norm statistics) and gradients are
    restored, and DEQ layers solve from empty warm starts and get theirs back, so the measured step does not change
    the run (nor make a resumed run, which measures again, differ). :class:`UnmeasurableStep` where this torch
    cannot measure the step (module docstring)."""
    params = list(module.parameters())
    grads = [p.grad for p in params]
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    for p in params:
        p.grad = None
    warm_starts = set_aside_warm_starts(module)
    try:
        with torch.random.fork_rng(), SavedTensorMeter(exclude=params) as meter, torch.enable_grad():
            step()
    except RuntimeError as err:  # torch.func under the saved-tensor hooks of a torch before 2.14
        if measures_func_transforms() or "saved tensor hooks" not in str(err):
            raise
        raise UnmeasurableStep(f"torch {torch.__version__} cannot measure the activation memory of a step that runs "
                               "torch.func (the exact DEQ backward); torch 2.14 can") from err
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        restore_warm_starts(warm_starts)
    return meter.bytes


def parameter_count(module: torch.nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameters."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


class _ProbeBudgetSpent(Exception):
    """Raised inside a probe once it has run its operations (the peak of a repeated step is seen by then)."""


def peak_tensor_bytes(fn: Callable[[], Any], max_ops: int | None = None) -> int:
    """The peak of the bytes held by tensors that ``fn()`` creates and keeps alive at once (each storage counted
    once, released when the tensor that created it is freed), on any device; parameters and tensors made before
    the call are not counted. With ``max_ops``, ``fn`` is stopped after that many operations and the peak so far
    returned: a sampler repeats one step, whose peak the first few show. An estimate (a storage freed while a
    view of it lives is counted as freed), not the allocator's figure.

    >>> peak_tensor_bytes(lambda: torch.ones(1000).sum())  # float32 1000 (4000 bytes), then the 4-byte sum
    4004
    """
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    live: dict[tuple, int] = {}
    state = {"bytes": 0, "peak": 0, "ops": 0}

    def free(key: tuple) -> None:
        state["bytes"] -= live.pop(key, 0)

    class Meter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and (key := _storage_key(t)) not in live:
                    size = live[key] = _storage_nbytes(t)
                    state["bytes"] += size
                    state["peak"] = max(state["peak"], state["bytes"])
                    weakref.finalize(t, free, key)
            state["ops"] += 1
            if max_ops is not None and state["ops"] >= max_ops:
                raise _ProbeBudgetSpent
            return out

    try:
        with Meter():
            fn()
    except _ProbeBudgetSpent:
        pass
    return state["peak"]
