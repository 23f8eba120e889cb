"""The DEQ layer: a fixed point found without a graph, re-attached by differentiable steps.

``z = DEQ(func)(u)`` returns ``z* = func(z*, u)``. The solver runs under ``torch.no_grad()``; what autograd
records depends on ``backward``:

* ``"phantom"`` (default): ``phantom_steps`` K damped steps ``z <- lam*func(z, u) + (1-lam)*z`` from the
  detached fixed point: the K-term Neumann truncation of the implicit derivative, in ordinary autograd
  operations, so second derivatives (score matching) work through them; memory depends on K only.
* ``"unroll"``: every Picard iteration recorded (the memory-hungry exact reference for tests and benchmarks).
* ``"ift"``: one re-attaching step whose gradient a backward hook corrects by solving ``g = J^T g + grad``:
  exact for first-order losses. The hook records no graph, so it raises under ``create_graph=True`` rather
  than give a silently wrong second derivative. The solve is ``ift_solver``'s: ``"picard"`` (the default) sums
  the Neumann series, which diverges once the Jacobian's spectral radius reaches 1; ``"anderson"`` or
  ``"broyden"`` need only ``I - J`` to be invertible, as the forward's Anderson solve does.
* ``"implicit"``: derivatives of every order of the exact fixed point (:mod:`.implicit`), each one more adjoint
  solve in differentiable operations; memory: a few evaluations of the map's graph, whatever the iterations. A map
  linear in ``z`` (``affine_weight()``) is solved directly. The adjoint solves use the forward's solver options
  with ``tol`` as a relative residual (a gradient's scale is arbitrary); their statistics are ``adjoint_stats``.

Under autocast the solve, its residuals, the solvers' linear algebra and the IFT backward run in float32 (a
bfloat16 residual cannot meet a tolerance of 1e-5, and ``linalg.solve`` has no bfloat16 kernel); the phantom
steps, the only differentiable part, run under the surrounding autocast.

``check_every`` (``k > 1``: the residual read every ``k``-th iteration, ``0``: never) spares the per-iteration
host sync of the stopping test; the statistics then stay device tensors, non-convergence is counted on the device
and warned when :meth:`DEQ.read_deferred` reads them.

>>> import torch
>>> from torch import nn
>>> class Map(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.lin = nn.Linear(4, 4)
...     def forward(self, z, u):
...         return torch.tanh(0.5 * self.lin(z) + u)
>>> deq = DEQ(Map(), solver="anderson", tol=1e-5, max_iter=100)
>>> u = torch.randn(3, 4)
>>> z = deq(u)
>>> bool(torch.allclose(z, deq.func(z, u), atol=1e-5)), deq.stats.converged
(True, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from ..errors import check_count, check_real, choice_error
from .implicit import FixedPoint, Level, direct_fixed_point, is_affine, map_value
from .solvers import Solver, SolverStats, check_every_count, check_stopping, get_solver, picard, residual_stats

BACKWARD_MODES = ("phantom", "unroll", "ift", "implicit")
# The highest order of derivative through the layer that each backward mode gives correctly (None: any order).
# IFT's backward hook records no graph, so a gradient of a gradient through it is silently wrong.
MAX_DERIVATIVE_ORDER: dict[str, int | None] = {"phantom": None, "unroll": None, "ift": 1, "implicit": None}


def check_backward(backward: str) -> None:
    if backward not in BACKWARD_MODES:
        raise choice_error("DEQ backward", backward, BACKWARD_MODES)


def _check_counts(max_iter: int, phantom_steps: int, ift_max_iter: int) -> None:
    check_count("DEQ max_iter", max_iter)
    # checked in every mode: deq_backward() may switch a layer to phantom later
    check_count("DEQ phantom_steps", phantom_steps,
                why=": with 0 steps the output carries no gradient to u or the parameters")
    check_count("DEQ ift_max_iter", ift_max_iter)


class DEQConvergenceWarning(RuntimeWarning):
    """The solver stopped at ``max_iter`` without meeting its tolerance."""


class SecondOrderIFTError(RuntimeError):
    """An IFT backward was asked for a second derivative, which it cannot give."""


class DEQ(nn.Module):
    """Deep-equilibrium layer around a fixed-point map ``func(z, u)``.

    Args:
        func: ``nn.Module`` with ``forward(z, u)``, a contraction in ``z``.
        solver: registered solver name (``picard``, ``anderson``, ``broyden`` or a user's).
        max_iter: iteration cap of the forward solve.
        tol: stopping tolerance (meaning set by ``stop_mode``/``per_sample``, see :mod:`.solvers`).
        stop_mode: ``"abs"`` or ``"rel"`` residual.
        per_sample: stop on every sample's residual instead of the whole-batch norm.
        backward: ``"phantom"``, ``"unroll"``, ``"ift"`` or ``"implicit"``.
        phantom_steps: K, differentiable steps after the solve (phantom mode); must be >= 1.
        phantom_damping: lambda in (0, 1] of the phantom steps.
        injection_prestep: before the K steps, apply ``func`` once with only the injection ``u`` carrying
            gradient (the reference code's pattern; requires ``func(z, u) = h(z) + u``). A ``func`` with a
            method ``prestep_residual(z, u)`` supplies ``h`` itself (used for a reference variant).
        warm_start: start from the previous fixed point when the input shape and device repeat (never under
            ``"unroll"``, whose derivative depends on the start).
        ift_max_iter, ift_tol: iteration cap and relative tolerance of the IFT backward's fixed-point solve.
        ift_solver: registered solver of the IFT backward's solve (``picard``: the Neumann series).
        warn_on_nonconvergence: emit :class:`DEQConvergenceWarning` when ``max_iter`` is hit.
        check_every: host convergence test every this many iterations of the forward and IFT backward solves
            (1: every one; 0: never, ``max_iter`` / ``ift_max_iter`` iterations; see the module docstring).
    """

    def __init__(
        self,
        func: nn.Module,
        solver: str = "anderson",
        max_iter: int = 128,
        tol: float = 1e-5,
        stop_mode: Literal["abs", "rel"] = "abs",
        per_sample: bool = False,
        backward: Literal["phantom", "unroll", "ift", "implicit"] = "phantom",
        phantom_steps: int = 2,
        phantom_damping: float = 1.0,
        injection_prestep: bool = False,
        warm_start: bool = False,
        ift_max_iter: int = 200,
        ift_tol: float = 1e-8,
        ift_solver: str = "picard",
        warn_on_nonconvergence: bool = True,
        check_every: int = 1,
    ):
        super().__init__()
        get_solver(solver)  # fail early on unknown names
        get_solver(ift_solver, "DEQ ift_solver")
        check_stopping(tol, stop_mode)
        check_backward(backward)
        _check_counts(max_iter, phantom_steps, ift_max_iter)
        check_real("DEQ phantom_damping", phantom_damping, high=1.0)
        check_real("DEQ ift_tol", ift_tol)
        check_every_count(check_every)
        self.func = func
        self.solver = solver
        self.max_iter = max_iter
        self.tol = tol
        self.stop_mode = stop_mode
        self.per_sample = per_sample
        self.backward = backward
        self.phantom_steps = phantom_steps
        self.phantom_damping = phantom_damping
        self.injection_prestep = injection_prestep
        self.warm_start = warm_start
        self.ift_max_iter = ift_max_iter
        self.ift_tol = ift_tol
        self.ift_solver = ift_solver
        self.warn_on_nonconvergence = warn_on_nonconvergence
        self.check_every = check_every
        self.stats: SolverStats | None = None
        # backward="implicit": the last adjoint solve of each nesting level (1: a first derivative's, 2: ...)
        self.adjoint_stats: dict[int, SolverStats] = {}
        # check_every != 1: device counters since the last read_deferred() (not in checkpoints)
        self._pending: dict[str, torch.Tensor] = {}
        # [IFT backward solves, those that missed ift_tol] since construction, on the device (ift_failure_fraction)
        self.ift_counts: torch.Tensor | None = None
        # Plain data, outside the state dict (warm_starts() saves them); every process (DDP rank) keeps its own. Not
        # a buffer: the set of a module's buffers must not change when a forward fills the cache (weight averaging
        # pairs buffers by order).
        self.z_cache: torch.Tensor | None = None
        self.adjoint_cache: dict[int, torch.Tensor] = {}  # warm starts of the adjoint solves, per level

    def extra_repr(self) -> str:
        return (
            f"solver={self.solver}, max_iter={self.max_iter}, tol={self.tol}, backward={self.backward}, "
            f"phantom_steps={self.phantom_steps}, phantom_damping={self.phantom_damping}"
            + (f", check_every={self.check_every}" if self.check_every != 1 else "")
            + (f", ift_solver={self.ift_solver}" if self.ift_solver != "picard" else "")
        )

    def warm_starts(self) -> dict[str, torch.Tensor]:
        """The solver starts this layer carries from one call to the next: its last fixed point (``"z"``) and its
        adjoint solves' last solutions (``"adjoint_<level>"``). A training resumed with them (:meth:`load_warm_starts`)
        continues exactly as if it had not stopped."""
        starts = {} if self.z_cache is None else {"z": self.z_cache}
        return starts | {f"adjoint_{level}": w for level, w in self.adjoint_cache.items()}

    def load_warm_starts(self, starts: dict[str, torch.Tensor]) -> None:
        """Carry on from :meth:`warm_starts` (each moved to the device of the call that first uses it)."""
        self.z_cache = starts.get("z")
        self.adjoint_cache = {int(key.removeprefix("adjoint_")): w for key, w in starts.items()
                              if key.startswith("adjoint_")}

    def _start(self, u: torch.Tensor, z0: torch.Tensor | None) -> torch.Tensor:
        if z0 is not None:
            return z0.detach()
        cache = self.z_cache
        if not (self._warm and cache is not None and cache.shape == u.shape):
            return torch.zeros_like(u)
        # a cache from a half-precision (autocast) step used outside autocast: in the input's dtype (a no-op else)
        return cache.to(u.device) if torch.is_autocast_enabled(u.device.type) else cache.to(u.device, u.dtype)

    @property
    def _check_every_option(self) -> dict[str, int]:
        # registered solvers of users need not know check_every: it is passed only when it is not the default
        return {} if self.check_every == 1 else {"check_every": self.check_every}

    @property
    def _warm(self) -> bool:
        # Under "unroll" the derivative is that of the recorded trajectory, which depends on its start: a warm
        # start would cut it to a few steps (a few Neumann terms), so unrolls start cold and keep no cache.
        return self.warm_start and self.backward != "unroll"

    def _run_solver(self, solver: Solver, u: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                    z_init: torch.Tensor) -> torch.Tensor:
        """The forward solve of ``z = func(z, u)`` (or of ``z = u(z)`` for a map ``u`` given whole)."""
        step = u if callable(u) else lambda z: self.func(z, u)
        z, stats = solver(
            step, z_init, tol=self.tol, max_iter=self.max_iter, stop_mode=self.stop_mode,
            per_sample=self.per_sample, **self._check_every_option,
        )
        self._record(stats)
        return z

    def _count_ift(self, failed: torch.Tensor) -> None:
        step = torch.stack([torch.ones_like(failed, dtype=torch.float32), failed.detach().to(torch.float32)])
        self.ift_counts = step if self.ift_counts is None else self.ift_counts.to(step.device) + step

    def ift_failure_fraction(self) -> torch.Tensor | None:
        """The fraction of IFT backward solves that missed ``ift_tol`` (device tensor; None before the first)."""
        if self.ift_counts is None:
            return None
        return self.ift_counts[1] / self.ift_counts[0]

    def _count(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float32)
        self._pending[name] = self._pending[name] + value if name in self._pending else value

    def take_deferred(self) -> dict[str, torch.Tensor]:
        """The device counters ``solves``, ``unconverged`` and ``backward_failures`` since the last take (emptied);
        reading them is the caller's host sync (batched with others by the training step)."""
        pending, self._pending = self._pending, {}
        return pending

    def read_deferred(self) -> dict[str, float]:
        """:meth:`take_deferred` read with one host sync, warned about by :meth:`report_deferred`."""
        pending = self.take_deferred()
        if not pending:
            return {}
        values = dict(zip(pending, torch.stack(list(pending.values())).tolist(), strict=True))
        self.report_deferred(values)
        return values

    def report_deferred(self, values: dict[str, float]) -> None:
        """The warning of :meth:`read_deferred` for counts already read (by a caller that batched the sync)."""
        missed, failed = values.get("unconverged", 0.0), values.get("backward_failures", 0.0)
        if (missed or failed) and self.warn_on_nonconvergence:
            warnings.warn(
                f"DEQ solver {self.solver!r} (check_every={self.check_every}): {int(missed)} of "
                f"{int(values.get('solves', 0))} solves since the last report did not meet tol {self.tol:.1e} in "
                f"{self.max_iter} iterations; {int(failed)} IFT backward solves did not meet ift_tol "
                f"{self.ift_tol:.1e}",
                DEQConvergenceWarning,
                stacklevel=3,
            )

    def _record(self, stats: SolverStats, level: int = 0, device: torch.device | None = None) -> None:
        """Keep a solve's statistics and warn if it missed its tolerance (``level`` > 0: an adjoint solve, the
        IFT backward's or one of ``backward="implicit"``, counted with the backward solves)."""
        if level:
            self.adjoint_stats[level] = stats
            failed = ~stats.converged if stats.deferred else torch.tensor(not stats.converged, device=device)
            self._count_ift(failed)
        else:
            self.stats = stats
        if stats.deferred:  # counted on the device, warned when read (at most once per read)
            if level:
                self._count("backward_failures", ~stats.converged)
                return
            self._count("solves", torch.ones((), device=stats.converged.device))
            self._count("unconverged", ~stats.converged)
            return
        if not stats.converged and self.warn_on_nonconvergence:
            what = ("IFT backward solve of solver" if self.backward == "ift" else
                    f"adjoint solve (level {level}) of solver") if level else "solver"
            warnings.warn(
                f"DEQ {what} {stats.solver!r} did not converge in {stats.nstep} iterations: "
                f"abs residual {stats.abs_residual:.3e}, rel residual {stats.rel_residual:.3e}, "
                f"tol {stats.tol:.1e} ({stats.stop_mode}, {'per sample' if stats.per_sample else 'batch'})",
                DEQConvergenceWarning,
                stacklevel=3,
            )

    def forward(self, u: torch.Tensor, z0: torch.Tensor | None = None) -> torch.Tensor:
        z_init = self._start(u, z0)
        if self.backward == "unroll":  # every Picard iteration recorded by autograd
            with _float32_solve(u) as cast:
                z = self._run_solver(picard, cast(u), cast(z_init))
        elif self.backward == "implicit":
            z = self._implicit(u, z_init)
        else:
            with torch.no_grad(), _float32_solve(u) as cast:
                z_star = self._run_solver(get_solver(self.solver), cast(u.detach()), cast(z_init))
            z = self._ift(z_star, u) if self.backward == "ift" else self._phantom(z_star, u)
        if self._warm:
            self.z_cache = z.detach().clone()
        return z

    @property
    def direct(self) -> bool:
        """True when ``backward="implicit"`` solves this layer's map directly (a map linear in ``z``)."""
        return self.backward == "implicit" and is_affine(self.func)

    def _implicit(self, u: torch.Tensor, z_init: torch.Tensor) -> torch.Tensor:
        with _float32_solve(u) as cast:
            u = cast(u)
            if self.direct and u.dim() == 2:
                z = direct_fixed_point(self.func, u)
                with torch.no_grad():
                    self._record(residual_stats("direct", z, self.func(z, u), tol=self.tol, stop_mode=self.stop_mode,
                                                per_sample=self.per_sample, check_every=self.check_every))
                return z
            # the map's trainable tensors are explicit inputs of the Function (its partials are taken in them)
            named = [(n, p) for n, p in self.func.named_parameters() if p.requires_grad]
            additive = frozenset({0}) if getattr(self.func, "additive_injection", False) else frozenset()
            level = Level(self, map_value(self.func, [n for n, _ in named]), additive=additive)
            # as views, not leaves: the engine can then tell whether a backward uses their partials (implicit._wanted);
            # under no_grad a view would have no gradient function, and no backward comes
            params = (p.view_as(p) if torch.is_grad_enabled() else p for _, p in named)
            return FixedPoint.apply(level, cast(z_init), u, *params)

    def solve_level(self, level: int, step: Callable[[torch.Tensor], torch.Tensor], like: torch.Tensor,
                    start: torch.Tensor | None) -> torch.Tensor:
        """Solve ``z = step(z)`` for level ``level`` of ``backward="implicit"`` (0: the forward, from ``start``;
        above: the adjoint solves, warm-started from the last of their level when ``warm_start`` is set)."""
        solver = get_solver(self.solver)
        if level == 0:
            return self._run_solver(solver, step, start if start is not None else torch.zeros_like(like))
        cache = self.adjoint_cache.get(level)
        warm = self.warm_start and cache is not None and cache.shape == like.shape
        w0 = cache.to(like.device, like.dtype) if warm else torch.zeros_like(like)
        w, stats = solver(step, w0, tol=self.tol, max_iter=self.max_iter, stop_mode="rel",
                          per_sample=self.per_sample, **self._check_every_option)
        self._record(stats, level, like.device)
        if self.warm_start:
            self.adjoint_cache[level] = w.detach().clone()
        return w

    def _phantom(self, z_star: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        z = z_star.detach()
        if self.injection_prestep:
            with torch.no_grad():  # a map may define its own pre-step residual (e.g. a reference variant)
                h = self.func.prestep_residual(z, u) if hasattr(self.func, "prestep_residual") else self.func(z, u) - u
            z = h + u
        lam = self.phantom_damping
        for _ in range(self.phantom_steps):
            fz = self.func(z, u)
            z = fz if lam == 1.0 else lam * fz + (1 - lam) * z
        return z

    def _ift(self, z_star: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        with _float32_solve(u) as cast:  # the backward solve iterates J^T g: float32, as the forward solve
            z_in = cast(z_star.detach()).requires_grad_(True)
            fz = self.func(z_in, cast(u))
        if not fz.requires_grad:  # nothing to differentiate (e.g. under no_grad)
            return fz
        solver = get_solver(self.ift_solver)

        def implicit_grad(grad: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():
                raise SecondOrderIFTError(
                    "DEQ backward='ift' cannot be differentiated twice: a score-matching loss (exact SM, "
                    "SSM, SSM-VR, DSM on an energy) takes create_graph=True derivatives through the layer "
                    "and would get silently wrong parameter gradients. Use backward='implicit' (exact), 'phantom' "
                    "or 'unroll'."
                )

            def step(g: torch.Tensor) -> torch.Tensor:  # g = J^T g + grad, J = d func / d z at the fixed point
                return torch.autograd.grad(fz, z_in, g, retain_graph=True)[0] + grad

            # from grad, the Neumann series' first term; the tolerance is relative (a gradient's scale is arbitrary)
            g, stats = solver(step, grad, tol=self.ift_tol, max_iter=self.ift_max_iter, stop_mode="rel",
                              **self._check_every_option)
            self._record(stats, level=1, device=g.device)
            return g

        # The hook sits on a view of fz, not on fz: a hook on fz's own graph node that refers to fz would make a
        # reference cycle through autograd's C++ graph, which Python's collector cannot free (every step's graph
        # would leak). It also keeps the inner vector-Jacobian products above from passing through the hook.
        out = fz.view_as(fz)
        out.register_hook(implicit_grad)
        return out


def set_aside_warm_starts(module: nn.Module) -> list[tuple[DEQ, dict[str, torch.Tensor]]]:
    """Empty the warm starts of every DEQ layer in ``module`` (:meth:`DEQ.warm_starts`), returning them for
    :func:`restore_warm_starts`: an evaluation or a sampler between training steps starts cold and leaves the
    training's starts as it found them."""
    kept = [(layer, layer.warm_starts()) for layer in module.modules() if isinstance(layer, DEQ)]
    for layer, _ in kept:
        layer.load_warm_starts({})
    return kept


def restore_warm_starts(kept: list[tuple[DEQ, dict[str, torch.Tensor]]]) -> None:
    """Give back the warm starts :func:`set_aside_warm_starts` took."""
    for layer, starts in kept:
        layer.load_warm_starts(starts)


@contextmanager
def _float32_solve(u: torch.Tensor) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Within an autocast region: autocast off and a cast of half-precision tensors to float32; else the identity."""
    device = u.device.type
    if not torch.is_autocast_enabled(device):
        yield lambda t: t
        return
    with torch.autocast(device, enabled=False):
        yield lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


DEQFactory = Callable[[nn.Module], DEQ]  # DEQ options bound (a config's ``deq:``), the fixed-point map still to come
