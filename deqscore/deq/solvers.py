"""Fixed-point solvers behind one signature, kept in a registry.

Every solver has the signature ``solver(f, z0, *, tol, max_iter, stop_mode, per_sample) -> (z, stats)``
where ``f`` maps a tensor to a tensor of the same shape and ``z0`` is the starting point. Solvers work on the
flattened per-sample view ``[B, d]`` and stop when the residual ``||f(z) - z||`` meets ``tol``:

* ``stop_mode="abs"``: absolute L2 residual; ``"rel"``: divided by ``||f(z)||``;
* ``per_sample=False``: one norm over the whole batch tensor (as the reference code);
  ``per_sample=True``: every sample's own norm must meet ``tol``.

New solvers are added with :func:`register_solver`:

>>> import torch
>>> from deqscore.deq.solvers import get_solver
>>> z, stats = get_solver("anderson")(lambda z: 0.5 * z + 1.0, torch.zeros(2, 3), tol=1e-8, max_iter=50)
>>> bool(torch.allclose(z, torch.full((2, 3), 2.0))), stats.converged
(True, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError, check_real, choice_error

Tensor = torch.Tensor
FixedPointMap = Callable[[Tensor], Tensor]
Solver = Callable[..., tuple[Tensor, "SolverStats"]]

STOP_MODES = ("abs", "rel")


class NonFiniteIterateError(FloatingPointError):
    """Raised when a solver iterate becomes NaN or Inf."""


@dataclass
class SolverStats:
    """What one solve did: iterations (function evaluations), final residuals and convergence.

    A solve with ``check_every != 1`` leaves the residuals and the converged flag as device tensors (reading
    them is a host sync); :meth:`resolved` gives the plain numbers.
    """

    solver: str
    nstep: int
    abs_residual: float | Tensor
    rel_residual: float | Tensor
    converged: bool | Tensor
    tol: float
    stop_mode: str
    per_sample: bool
    history: list[float] = field(default_factory=list)

    @property
    def deferred(self) -> bool:
        """True while the numbers are device tensors."""
        return isinstance(self.converged, Tensor)

    def resolved(self) -> SolverStats:
        """These statistics with plain numbers (one host sync if they are device tensors)."""
        if not self.deferred:
            return self
        abs_r, rel_r, conv = torch.stack([torch.as_tensor(v, dtype=torch.float32).to(self.converged.device)
                                          for v in (self.abs_residual, self.rel_residual, self.converged)]).tolist()
        return SolverStats(self.solver, self.nstep, abs_r, rel_r, bool(conv), self.tol, self.stop_mode,
                           self.per_sample, list(self.history))

    def as_dict(self) -> dict[str, float]:
        """Numbers for loggers."""
        stats = self.resolved()
        return {
            "nstep": float(stats.nstep),
            "abs_residual": float(stats.abs_residual),
            "rel_residual": float(stats.rel_residual),
            "converged": float(stats.converged),
        }


_REGISTRY: dict[str, Solver] = {}


def register_solver(name: str) -> Callable[[Solver], Solver]:
    """Decorator adding a solver to the registry under ``name``."""

    def add(fn: Solver) -> Solver:
        if name in _REGISTRY:
            raise ValueError(f"a solver named {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return add


def available_solvers() -> list[str]:
    """Names of all registered solvers."""
    return sorted(_REGISTRY)


def get_solver(name: str, option: str = "DEQ solver") -> Solver:
    """Look a solver up by name; unknown names raise a ``ValueError`` naming ``option`` and the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise choice_error(option, name, available_solvers()) from None


def check_stopping(tol: float, stop_mode: str) -> None:
    """Raise :class:`ConfigError` for a tolerance that is not finite and positive or an unknown stopping mode."""
    if stop_mode not in STOP_MODES:
        raise choice_error("DEQ stop_mode", stop_mode, STOP_MODES)
    check_real("DEQ tol", tol)


def check_every_count(check_every: int) -> None:
    """Raise :class:`ConfigError` for a ``check_every`` that is not a count >= 0."""
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
        raise ConfigError(f"DEQ check_every must be an integer >= 0 (1: check every iteration, k: every k-th, "
                          f"0: never, max_iter iterations), got {check_every!r}")


ROUNDING_EPS = 64  # a direct solve's residual within this many epsilons of f(z) is its rounding


class _Monitor:
    """Residual bookkeeping shared by all solvers (stopping rule, NaN check, history).

    ``check_every=1`` reads the residual on the host at every iteration (a device sync each). Otherwise the
    residual is computed on the device at every iteration and read only at every ``check_every``-th one (never
    for 0: the solve runs ``max_iter`` iterations); the final numbers stay device tensors in the stats. A NaN/Inf
    iterate is then not raised here: it reaches the output, and the training step's finiteness guard stops it.
    """

    def __init__(self, name: str, tol: float, stop_mode: str, per_sample: bool, check_every: int = 1):
        check_stopping(tol, stop_mode)
        check_every_count(check_every)
        self.name, self.tol, self.stop_mode, self.per_sample = name, tol, stop_mode, per_sample
        self.check_every = check_every
        self.history: list[float] = []
        self.abs: float | Tensor = float("inf")
        self.rel: float | Tensor = float("inf")
        self.nstep = 0

    def update(self, z: Tensor, fz: Tensor) -> bool:
        """Record the residual of ``f(z) - z`` (both ``[B, d]``); return True when the tolerance is met."""
        self.nstep += 1
        diff, fz = (fz - z).detach(), fz.detach()
        if self.per_sample:
            abs_r = diff.norm(dim=1)
            rel_r = abs_r / (fz.norm(dim=1) + 1e-12)
            numbers = torch.stack([abs_r.max(), rel_r.max()])
        else:
            abs_t = diff.norm()
            numbers = torch.stack([abs_t, abs_t / (fz.norm() + 1e-12)])
        if self.check_every != 1:  # the numbers stay on the device; read only at a checked iteration
            self.abs, self.rel = numbers[0], numbers[1]
            if self.check_every == 0 or self.nstep % self.check_every:
                return False
        abs_r, rel_r = numbers.tolist()  # one device sync per (checked) iteration
        if self.check_every == 1:
            self.abs, self.rel = abs_r, rel_r
        if not math.isfinite(abs_r):  # a NaN/Inf anywhere in f(z) makes the norm non-finite
            raise NonFiniteIterateError(
                f"DEQ solver {self.name!r}: non-finite values (NaN/Inf) in the iterate at iteration "
                f"{self.nstep}; the fixed-point map diverged (check its contraction/normalisation)"
            )
        crit = abs_r if self.stop_mode == "abs" else rel_r
        self.history.append(crit)
        return crit < self.tol

    def stats(self, converged: bool) -> SolverStats:
        abs_r, rel_r = self.abs, self.rel
        conv: bool | Tensor = converged
        if isinstance(abs_r, Tensor) and isinstance(rel_r, Tensor):  # check_every != 1: decided on the device
            conv = (abs_r if self.stop_mode == "abs" else rel_r) < self.tol
        return SolverStats(
            self.name, self.nstep, abs_r, rel_r, conv, self.tol, self.stop_mode, self.per_sample, self.history,
        )


def residual_stats(name: str, z: Tensor, fz: Tensor, *, tol: float, stop_mode: str = "abs", per_sample: bool = False,
                   check_every: int = 1) -> SolverStats:
    """The statistics of a solution ``z`` found without iterating (a direct solve): one evaluation ``fz = f(z)``,
    its residual judged by the solvers' stopping rule, or within :data:`ROUNDING_EPS` machine epsilons of ``fz``
    (no iteration can lower what is rounding: large ``z`` in float32 sit above an absolute tolerance)."""
    mon = _Monitor(name, tol, stop_mode, per_sample, check_every)
    converged = mon.update(z.reshape(z.shape[0], -1), fz.reshape(z.shape[0], -1))
    stats = mon.stats(converged)
    stats.converged = stats.converged | (stats.rel_residual <= ROUNDING_EPS * torch.finfo(fz.dtype).eps)
    return stats


def _flat(f: FixedPointMap, shape: torch.Size) -> Callable[[Tensor], Tensor]:
    return lambda z: f(z.view(shape)).reshape(shape[0], -1)


@register_solver("picard")
def picard(
    f: FixedPointMap,
    z0: Tensor,
    *,
    tol: float = 1e-5,
    max_iter: int = 128,
    stop_mode: str = "abs",
    per_sample: bool = False,
    check_every: int = 1,
) -> tuple[Tensor, SolverStats]:
    """Plain fixed-point iteration ``z <- f(z)``; returns the last image ``f(z)``."""
    mon = _Monitor("picard", tol, stop_mode, per_sample, check_every)
    z = z0
    converged = False
    for _ in range(max_iter):
        fz = f(z)
        converged = mon.update(z.reshape(z.shape[0], -1), fz.reshape(z.shape[0], -1))
        z = fz
        if converged:
            break
    return z, mon.stats(converged)


@register_solver("anderson")
def anderson(
    f: FixedPointMap,
    z0: Tensor,
    *,
    tol: float = 1e-5,
    max_iter: int = 128,
    stop_mode: str = "abs",
    per_sample: bool = False,
    check_every: int = 1,
    m: int = 5,
    lam: float = 1e-4,
    beta: float = 1.0,
) -> tuple[Tensor, SolverStats]:
    """Anderson acceleration (type II) with memory ``m``, relative ridge ``lam`` and mixing ``beta``, per sample."""
    shape = z0.shape
    bsz = shape[0]
    fl = _flat(f, shape)
    mon = _Monitor("anderson", tol, stop_mode, per_sample, check_every)
    x = z0.reshape(bsz, -1)
    d = x.shape[1]
    X = x.new_zeros(bsz, m, d)  # past iterates
    F = x.new_zeros(bsz, m, d)  # their images
    X[:, 0], F[:, 0] = x, fl(x)
    converged = mon.update(X[:, 0], F[:, 0])
    last = F[:, 0]
    if converged or max_iter <= 1:
        return last.view(shape), mon.stats(converged)
    X[:, 1], F[:, 1] = F[:, 0], fl(F[:, 0])
    converged = mon.update(X[:, 1], F[:, 1])
    last = F[:, 1]
    H = x.new_zeros(bsz, m + 1, m + 1)
    H[:, 0, 1:] = H[:, 1:, 0] = 1
    y = x.new_zeros(bsz, m + 1, 1)
    y[:, 0] = 1
    k = 2
    while not converged and k < max_iter:
        n = min(k, m)
        G = F[:, :n] - X[:, :n]
        GG = torch.bmm(G, G.transpose(1, 2))
        j = (k - 1) % m  # slot of the latest iterate
        # Ridge relative to the latest squared residual: an absolute ridge (or one scaled by the oldest, largest
        # residuals) swamps the small recent residuals and stalls a fast-converging solve.
        ridge = lam * GG[:, j, j].clamp_min(1e-30)
        H[:, 1 : n + 1, 1 : n + 1] = GG + ridge[:, None, None] * torch.eye(n, dtype=x.dtype, device=x.device)
        sol, info = torch.linalg.solve_ex(H[:, : n + 1, : n + 1], y[:, : n + 1])
        alpha = sol[:, 1 : n + 1, 0]
        # a sample whose residuals vanished (converged exactly) gives a singular system: plain Picard step
        bad = (info != 0) | ~torch.isfinite(alpha).all(1)
        plain = torch.zeros_like(alpha)
        plain[:, j] = 1.0
        alpha = torch.where(bad[:, None], plain, alpha)
        # sum(alpha) = 1, so sum_i alpha_i F_i = F_last + sum_i alpha_i (F_i - F_last): written as a correction
        # of the last image, the rounding error scales with the (vanishing) differences, not with ||F||; the
        # plain weighted sum stalls at ~eps * ||F|| in float32.
        mix_f = F[:, j] + (alpha[:, None] @ (F[:, :n] - F[:, j : j + 1]))[:, 0]
        xk = mix_f
        if beta != 1.0:
            mix_x = X[:, j] + (alpha[:, None] @ (X[:, :n] - X[:, j : j + 1]))[:, 0]
            xk = beta * mix_f + (1 - beta) * mix_x
        X[:, k % m] = xk
        F[:, k % m] = fl(xk)
        converged = mon.update(X[:, k % m], F[:, k % m])
        last = F[:, k % m]
        k += 1
    return last.reshape(shape), mon.stats(converged)


@register_solver("broyden")
def broyden(
    f: FixedPointMap,
    z0: Tensor,
    *,
    tol: float = 1e-5,
    max_iter: int = 128,
    stop_mode: str = "abs",
    per_sample: bool = False,
    check_every: int = 1,
    memory: int = 64,
) -> tuple[Tensor, SolverStats]:
    """Limited-memory ("good") Broyden's method on ``g(z) = f(z) - z``, per sample.

    The inverse Jacobian of ``g`` is kept as ``-I + U V^T`` with at most ``memory`` rank-one terms, updated
    by Sherman-Morrison; when the memory is full it restarts from ``-I`` (dropping only the oldest terms
    breaks the secant conditions the later terms were built on, and can diverge).
    """
    shape = z0.shape
    bsz = shape[0]
    fl = _flat(f, shape)
    mon = _Monitor("broyden", tol, stop_mode, per_sample, check_every)
    x = z0.reshape(bsz, -1)
    fx = fl(x)
    gx = fx - x
    converged = mon.update(x, fx)
    last = fx
    U: list[Tensor] = []  # each [B, d]
    V: list[Tensor] = []

    def inv_jac(vec: Tensor) -> Tensor:  # (-I + U V^T) vec, per sample
        out = -vec
        for u, v in zip(U, V, strict=True):
            out = out + u * (v * vec).sum(1, keepdim=True)
        return out

    def inv_jac_t(vec: Tensor) -> Tensor:  # vec^T (-I + U V^T), per sample
        out = -vec
        for u, v in zip(U, V, strict=True):
            out = out + v * (u * vec).sum(1, keepdim=True)
        return out

    while not converged and mon.nstep < max_iter:
        dx = -inv_jac(gx)
        x_new = x + dx
        fx_new = fl(x_new)
        g_new = fx_new - x_new
        converged = mon.update(x_new, fx_new)
        last = fx_new
        dg = g_new - gx
        vt = inv_jac_t(dx)
        denom = (vt * dg).sum(1, keepdim=True)
        # a vanishing denominator (converged sample) gets no update rather than a huge one
        ok = denom.abs() > 1e-30
        u = torch.where(ok, (dx - inv_jac(dg)) / torch.where(ok, denom, torch.ones_like(denom)), 0.0)
        if len(U) == memory:
            U.clear()
            V.clear()
        U.append(u)
        V.append(vt)
        x, gx = x_new, g_new
    return last.reshape(shape), mon.stats(converged)
