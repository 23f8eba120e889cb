"""Derivatives of every order through a fixed point, at the memory of a few map evaluations.

``z* = f(z*, u; theta)`` defines ``z*(u, theta)``. Its vector-Jacobian product is ``vjp_{u,theta} f [w]`` with ``w`` the
fixed point of the *adjoint map* ``A(w) = J^T w + g`` (``J = df/dz`` at ``z*``, ``g`` the incoming gradient):
another fixed-point problem, with the same contraction (``J^T`` has ``J``'s spectrum). :class:`FixedPoint` is an
autograd Function whose forward solves a problem without a graph, and whose backward, written in differentiable
operations, solves the adjoint problem *with the same Function* and returns ``vjp_{inputs} f [w]``. A derivative of
that backward (``create_graph=True``: second, third ... derivatives) therefore meets a Function node again: every
further order is one more implicit solve, nothing of any solver's iterations is recorded, and the derivatives are
those of the exact fixed point to the solves' tolerance (the design of ``jax.lax.custom_root``; docs/method.md 2.9).

The partials of the map at the fixed point are taken with :func:`torch.func.vjp` on a function of explicit
tensors (``z`` an argument of its own, the map's parameters passed through :func:`torch.func.functional_call`):
``torch.autograd.grad`` through the saved output would lead back into the Function itself.

A problem of the nest is a :class:`Level`: level 0 is the layer's map, level ``k + 1`` the adjoint of level ``k``.
The solving itself (solver, tolerance, warm start, statistics, warnings) is the layer's: a level asks its host.

A map linear in ``z``, ``f(z, u) = z A^T + u`` (a method ``affine_weight()`` returning ``A``), has the closed form
``z* = u (I - A^T)^{-1}``: :func:`direct_fixed_point` solves it with one batched linear solve, which autograd
differentiates to any order by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn
from torch._C._functorch import is_legacy_batchedtensor
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import functional_call, vjp

Value = Callable[..., Tensor]  # value(z, *tensors) -> f(z; tensors), differentiable in all its arguments


class LevelHost(Protocol):
    """What a :class:`Level` asks of the layer that owns it: solve ``z = step(z)`` from ``start`` at ``level``."""

    def solve_level(self, level: int, step: Callable[[Tensor], Tensor], like: Tensor,
                    start: Tensor | None) -> Tensor: ...


class Level:
    """One fixed-point problem ``z = value(z, *tensors)`` of the nest (``outer``: the level it is the adjoint of).

    ``additive``: the indices of the tensors that enter ``value`` only as an added term (``value = h(z, ...) + t``,
    ``t`` of the output's shape): the vector-Jacobian product in ``t`` is the vector itself. ``absent``: those
    ``value`` does not depend on. No derivative depends on the values of either, so the Function saves a zero
    placeholder for them (no memory). A map ``f(z, u) = h(z) + u`` declares ``u`` additive
    (``additive_injection = True``); an adjoint map ``pull(w) + g`` has ``g`` additive, and its outer level's
    additive and absent tensors (shifted past ``z`` and ``g``) absent: ``pull`` is a derivative in ``z``."""

    def __init__(self, host: LevelHost, value: Value, index: int = 0, outer: Level | None = None,
                 additive: frozenset[int] = frozenset(), absent: frozenset[int] = frozenset()):
        self.host, self.value, self.index, self.outer = host, value, index, outer
        self.additive, self.absent = additive, absent
        self._adjoint: Level | None = None

    def adjoint(self) -> Level:
        """The problem ``w = A(w; z, g, *tensors) = vjp_z value(z, *tensors) [w] + g`` (built once, then kept)."""
        if self._adjoint is None:
            absent = frozenset(i + 2 for i in self.additive | self.absent)
            self._adjoint = Level(self.host, _adjoint_value(self.value), self.index + 1, outer=self,
                                  additive=frozenset({1}), absent=absent)
        return self._adjoint

    def step(self, tensors: Sequence[Tensor]) -> Callable[[Tensor], Tensor]:
        """The map to iterate, for a solve without a graph. An adjoint level linearises its outer map once (one
        evaluation of its graph, kept for the solve only): each iteration is then one vector-Jacobian product."""
        if self.outer is None:
            return lambda z: self.value(z, *tensors)
        z_outer, grad, *rest = tensors
        _, pull = vjp(lambda z: self.outer.value(z, *rest), z_outer)
        return lambda w: pull(w)[0] + grad

    def solve(self, tensors: Sequence[Tensor], start: Tensor | None) -> Tensor:
        like = tensors[0] if self.outer is None else tensors[1]  # the input u, or the incoming gradient
        with torch.no_grad():
            z = self.host.solve_level(self.index, self.step(tensors), like, start)
        # a solver may return a view of its history (Anderson's images): the Function saves its output, which
        # would keep the whole history alive until the step's backward
        return z.clone() if z.untyped_storage().nbytes() > z.numel() * z.element_size() else z


def _adjoint_value(value: Value) -> Value:
    def adjoint(w: Tensor, z: Tensor, grad: Tensor, *tensors: Tensor) -> Tensor:
        _, pull = vjp(lambda x: value(x, *tensors), z)
        return pull(w)[0] + grad

    return adjoint


class FixedPoint(torch.autograd.Function):
    """``FixedPoint.apply(level, start, *tensors)``: the solution of ``z = level.value(z, *tensors)``; ``start``
    (a tensor or None) is only the solver's initial guess. See the module docstring."""

    @staticmethod
    def forward(level: Level, start: Tensor | None, *tensors: Tensor) -> Tensor:
        return level.solve(tensors, start)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:
        level, _, *tensors = inputs
        ctx.level = level
        # where each input's gradient goes: a partial the engine will not use is not computed (_wanted)
        ctx.edges = [_edge(t) for t in tensors]
        for i in level.additive | level.absent:  # what the backward computes does not depend on their values
            tensors[i] = tensors[i].new_zeros(()).expand_as(tensors[i])
        ctx.save_for_backward(output, *tensors)

    @staticmethod
    def vmap(info, in_dims: tuple, level: Level, start: Tensor | None, *tensors: Tensor) -> tuple[Tensor, int]:
        """Under ``vmap`` (``autograd.grad(..., is_grads_batched=True)`` batches the incoming gradients): one solve
        per batch entry (a solver's stopping test cannot be batched)."""

        def entry(t: Tensor | None, dim: int | None, i: int) -> Tensor | None:
            return t if t is None or dim is None else t.select(dim, i)

        solutions = [FixedPoint.apply(level, entry(start, in_dims[1], i),
                                      *(entry(t, d, i) for t, d in zip(tensors, in_dims[2:], strict=True)))
                     for i in range(info.batch_size)]
        return torch.stack(solutions), 0

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        z, *tensors = ctx.saved_tensors
        needed = [need and _wanted(edge) for need, edge in zip(ctx.needs_input_grad[2:], ctx.edges, strict=True)]
        with torch.autocast(z.device.type, enabled=False):  # the nest runs in the forward's (float32) precision
            if is_legacy_batchedtensor(grad):  # autograd.grad(..., is_grads_batched=True)
                parts = _per_entry(lambda g: _pullback(ctx.level, needed, z, tensors, g), grad)
            else:
                parts = _pullback(ctx.level, needed, z, tensors, grad)
        return (None, None, *parts)


def _pullback(level: Level, needed: Sequence[bool], z: Tensor, tensors: Sequence[Tensor],
              grad: Tensor) -> list[Tensor | None]:
    """``vjp_{tensors} value(z*, tensors) [w]`` with ``w = J^T w + grad`` solved by :class:`FixedPoint` (so that a
    derivative of this is again an implicit solve); None for the tensors that need no gradient."""
    w = FixedPoint.apply(level.adjoint(), None, z, grad.to(z.dtype), *tensors)
    parts: list[Tensor | None] = [None] * len(tensors)
    wanted = []
    for i, need in enumerate(needed):
        if not need or i in level.absent:
            continue
        if i in level.additive and tensors[i].shape == w.shape:
            parts[i] = w  # vjp of an added term: the vector itself (no evaluation of the map recorded for it)
        else:
            wanted.append(i)
    if not wanted:
        return parts

    def value_of_wanted(*picked: Tensor) -> Tensor:
        full = list(tensors)
        for i, t in zip(wanted, picked, strict=True):
            full[i] = t
        return level.value(z, *full)

    _, pull = vjp(value_of_wanted, *(tensors[i] for i in wanted))
    for i, part in zip(wanted, pull(w), strict=True):
        parts[i] = part
    return parts


def _edge(t: Tensor) -> GradientEdge | bool:
    """Where ``t``'s gradient goes (False: nowhere; True: unknown, a view made under no_grad)."""
    if not t.requires_grad:
        return False
    return get_gradient_edge(t) if t.grad_fn is not None or t.is_leaf else True


def _wanted(edge: GradientEdge | bool) -> bool:
    """Whether the running backward will use the gradient sent along ``edge``: ``autograd.grad(..., inputs)``
    skips what does not lead to its inputs (the score's input gradient needs no parameter partial). Unknown (a leaf
    under ``autograd.grad``, which the engine cannot tell) counts as used."""
    if isinstance(edge, bool):
        return edge
    try:
        return bool(torch._C._will_engine_execute_node(edge.node))
    except RuntimeError:
        return True


def _per_entry(pullback: Callable[[Tensor], list[Tensor | None]], grad: Tensor) -> list[Tensor | None]:
    """``pullback`` of a gradient batched by ``autograd.grad(..., is_grads_batched=True)``, entry by entry.

    That option runs the backward under PyTorch's legacy vmap, where a solver's stopping test cannot run: the
    batch is taken out (``torch._remove_batch_dim`` at the current vmap level, which the legacy vmap does not
    expose otherwise), each entry's adjoint solved on its own, and the results batched again."""
    level = torch._C._vmapmode_increment_nesting() - 1
    torch._C._vmapmode_decrement_nesting()
    entries = torch._remove_batch_dim(grad, level, 1, 0)
    results = [pullback(g) for g in entries.unbind(0)]
    return [None if parts[0] is None else torch._add_batch_dim(torch.stack(parts), 0, level)
            for parts in zip(*results, strict=True)]


def map_value(func: nn.Module, names: Sequence[str]) -> Value:
    """``value(z, u, *params) = func(z, u)`` with the parameters ``names`` of ``func`` given explicitly."""

    def value(z: Tensor, u: Tensor, *params: Tensor) -> Tensor:
        return functional_call(func, dict(zip(names, params, strict=True)), (z, u))

    return value


def is_affine(func: nn.Module) -> bool:
    """True for a map that declares itself linear in z: ``func.affine_weight()`` is ``A`` with
    ``func(z, u) = z @ A.T + u`` (``z``, ``u`` of shape ``[B, d]``)."""
    return callable(getattr(func, "affine_weight", None))


def direct_fixed_point(func: nn.Module, u: Tensor) -> Tensor:
    """``z* = u (I - A^T)^{-1}`` for an affine map (:func:`is_affine`): ``z* (I - A)^T = u``, one linear solve,
    differentiable to any order by autograd (no iteration to record)."""
    a = func.affine_weight()
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    return torch.linalg.solve((eye - a).T.to(u.dtype), u, left=False)
