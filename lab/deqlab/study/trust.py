"""Trust figures of a trained DEQ: does the network compute the function the method assumes?

The method trains through K phantom steps from the fixed point; their derivative is the K-term Neumann truncation
of the implicit one, good when the map contracts fast at the fixed point and poor when it does not. A DEQ trained
past its contraction computes a different score from the one its loss assumes. Measured on the final weights and
one test batch (:func:`trust_figures`):

* ``contraction``: the spectral radius of the map's Jacobian ``J = d f / d z`` at the fixed point, by power
  iteration on ``J`` (Jacobian-vector products by the double-backward trick), the largest over the batch's
  samples; ``neumann_remainder`` is ``contraction ** K``, the share of the Neumann series the K steps leave out;
* ``derivative_rel_error``: the relative error of the layer's vector-Jacobian product with respect to its input
  (the way a score reaches ``x`` through the layer) from the phantom steps, against the implicit derivative
  solved to 1e-10;
* ``objective_error_scaled`` and ``gradient_rel_error``: the training objective's value and its parameter gradient
  as trained (phantom) against the same with every layer unrolled (the exact derivative of the converged solve,
  with a tighter tolerance), under the same random draws: for a score-matching loss this includes the trace term.
  Where the unrolled Picard solve diverges (a map past a contraction of 1, whose fixed point the layer's own
  solver still finds) and does not stall at the floor below, the reference is the layer's ``implicit`` derivative
  instead, by the layer's solver with the same tighter tolerance; ``exact_reference`` names the one used.
  The value's error is scaled by the larger of the exact value's magnitude and its standard deviation over
  :data:`SCALE_DRAWS` draws of the objective's randomness (a mean near zero would inflate a relative error:
  ``objective_rel_error``, kept for comparison); the gradient's cosine and norm ratio to the exact one beside it;
* ``exact_converged``, ``exact_residual`` and ``exact_at_floor``: whether every reference solve (an implicit
  reference's adjoint solves too) met its tolerance, the largest relative residual, and whether an unconverged
  one stalled at the precision's floor (:data:`FLOOR_EPS` machine epsilons): as converged as the dtype allows, not
  a failure;
* ``capped_solves``: the share of this batch's forward solves that stopped at ``max_iter`` unconverged;
* ``backward``: the layers' backward mode as trained (``phantom`` for K steps; ``implicit``'s derivatives are the
  exact ones, so its gradient error measures the solves' tolerances).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from deqscore.deq import DEQ, NonFiniteIterateError, deq_backward, get_solver

POWER_ITERATIONS = 50
IMPLICIT_TOL = 1e-10  # relative change of the implicit backward solve
IMPLICIT_MAX_ITER = 2000
UNROLL_TOL_FACTOR = 0.1  # the unrolled solve's tolerance against the layer's own (float32 allows little tighter)
UNROLL_MIN_ITER = 400  # the unrolled solve's iteration cap, at least
SCALE_DRAWS = 4  # draws of the exact objective whose spread scales its error
FLOOR_EPS = 64  # a relative residual within this many machine epsilons is the dtype's floor


def relative_error(approx: list[torch.Tensor | None], exact: list[torch.Tensor | None]) -> float:
    """``|approx - exact| / |exact|`` over matching tensors (a missing one counts as zeros)."""
    num = den = 0.0
    for a, e in zip(approx, exact, strict=True):
        if e is None:
            continue
        a = torch.zeros_like(e) if a is None else a
        num += float((a - e).pow(2).sum())
        den += float(e.pow(2).sum())
    return (num / den) ** 0.5 if den > 0 else float("nan")


def spectral_radius(layer: DEQ, z: torch.Tensor, u: torch.Tensor, iterations: int = POWER_ITERATIONS,
                    seed: int = 0) -> torch.Tensor:
    """Per sample, the spectral radius of ``d func / d z`` at ``z`` by power iteration (``|J^k v| / |J^(k-1) v|``
    after ``iterations`` steps); the map must not mix samples (true of every family's map)."""
    z = z.detach().requires_grad_(True)
    with torch.enable_grad():
        fz = layer.func(z, u.detach())
        w = torch.zeros_like(fz, requires_grad=True)
        (jt_w,) = torch.autograd.grad(fz, z, w, create_graph=True)  # linear in w: its w-derivative is J
        gen = torch.Generator(device=z.device).manual_seed(seed)
        v = torch.randn(z.shape, generator=gen, device=z.device, dtype=z.dtype)
        rate = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
        for _ in range(iterations):
            v = v / v.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, *[1] * (v.dim() - 1))
            (jv,) = torch.autograd.grad(jt_w, w, v, retain_graph=True)
            rate = jv.flatten(1).norm(dim=1)
            v = jv
    return rate.detach()


def derivative_error(layer: DEQ, z: torch.Tensor, u: torch.Tensor, seed: int = 0) -> float:
    """Relative error of ``w^T dz*/du`` through the layer's phantom steps against the implicit derivative
    ``(d func / d u)^T g`` with ``g = w + J^T g`` solved to :data:`IMPLICIT_TOL` by the layer's solver (Picard's
    Neumann series diverges past a contraction of 1; Anderson's solve does not)."""
    gen = torch.Generator(device=z.device).manual_seed(seed)
    w = torch.randn(z.shape, generator=gen, device=z.device, dtype=z.dtype)
    with torch.enable_grad():
        u_in = u.detach().requires_grad_(True)
        (phantom,) = torch.autograd.grad(layer(u_in, z0=z.detach()), u_in, w)
        z_in = z.detach().requires_grad_(True)
        fz = layer.func(z_in, u_in)

        def step(g: torch.Tensor) -> torch.Tensor:
            return w + torch.autograd.grad(fz, z_in, g, retain_graph=True)[0]

        g, _ = get_solver(layer.solver)(step, w, tol=IMPLICIT_TOL, max_iter=IMPLICIT_MAX_ITER, stop_mode="rel")
        (exact,) = torch.autograd.grad(fz, u_in, g)
    return relative_error([phantom], [exact])


@contextmanager
def captured_solves(layers: list[DEQ]) -> Iterator[list[tuple[DEQ, torch.Tensor, torch.Tensor, bool]]]:
    """Every forward of ``layers`` inside the block: (layer, input, fixed point, converged)."""
    seen: list[tuple[DEQ, torch.Tensor, torch.Tensor, bool]] = []

    def hook(layer, inputs, output):
        seen.append((layer, inputs[0].detach(), output.detach(), bool(layer.stats.converged)))

    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def tighter_solves(layers: list[DEQ]) -> Iterator[None]:
    """The layers' tolerances times :data:`UNROLL_TOL_FACTOR` and caps of at least :data:`UNROLL_MIN_ITER`."""
    saved = [(layer.tol, layer.max_iter, layer.warn_on_nonconvergence) for layer in layers]
    for layer in layers:
        layer.tol, layer.max_iter = layer.tol * UNROLL_TOL_FACTOR, max(layer.max_iter, UNROLL_MIN_ITER)
        layer.warn_on_nonconvergence = False
    try:
        yield
    finally:
        for layer, (tol, max_iter, warn) in zip(layers, saved, strict=True):
            layer.tol, layer.max_iter, layer.warn_on_nonconvergence = tol, max_iter, warn


def trust_figures(module, x: torch.Tensor, seed: int = 0) -> dict | None:
    """The figures of the module docstring for a :class:`~deqscore.lightning.ScoreModule` on batch ``x`` (already
    prepared); None for a module without a DEQ layer. The objective is the module's ``deq_objective`` term."""
    layers = module.deq_layers()
    if not layers:
        return None
    params = [p for p in module.parameters() if p.requires_grad]

    def objective(draw: int = seed, gradient: bool = True) -> tuple[torch.Tensor, tuple]:
        torch.manual_seed(draw)
        with torch.enable_grad():
            value = module.loss_terms(x)[module.deq_objective]
            grads = torch.autograd.grad(value, params, allow_unused=True) if gradient else ()
        return value.detach(), grads

    with captured_solves(layers) as solves:
        value, grads = objective()
    floor = FLOOR_EPS * torch.finfo(x.dtype).eps if x.dtype.is_floating_point else 0.0
    for reference in ("unroll", "implicit"):
        with deq_backward(module, reference), tighter_solves(layers):
            for layer in layers:
                layer.adjoint_stats.clear()  # only this reference's adjoint solves count
            try:
                exact_value, exact_grads = objective()
            except NonFiniteIterateError:  # an unrolled Picard solve that overflowed
                continue
            exact_converged, residual = reference_converged(layers, reference)
            if reference == "implicit" or exact_converged or residual <= floor:
                draws = torch.stack([objective(seed + 1 + k, gradient=False)[0] for k in range(SCALE_DRAWS)])
                break
    pairs = [(g, e) for g, e in zip(grads, exact_grads, strict=True) if e is not None]
    dot = sum(float((torch.zeros_like(e) if g is None else g).mul(e).sum()) for g, e in pairs)
    norm = sum(float(g.pow(2).sum()) for g, _ in pairs if g is not None) ** 0.5
    exact_norm = sum(float(e.pow(2).sum()) for _, e in pairs) ** 0.5
    scale = max(abs(float(exact_value)), float(draws.std()), 1e-30)
    radius = torch.cat([spectral_radius(layer, z, u, seed=seed) for layer, u, z, _ in solves])
    steps = max(layer.phantom_steps for layer in layers)
    contraction = float(radius.max())
    return {
        "contraction": contraction,
        "contraction_median": float(radius.median()),
        "backward": ",".join(sorted({layer.backward for layer in layers})),
        "phantom_steps": steps,
        "neumann_remainder": contraction**steps,
        "derivative_rel_error": max(derivative_error(layer, z, u, seed) for layer, u, z, _ in solves),
        "objective_rel_error": abs(float(value - exact_value)) / max(abs(float(exact_value)), 1e-30),
        "objective_error_scaled": abs(float(value - exact_value)) / scale,
        "gradient_rel_error": relative_error(list(grads), list(exact_grads)),
        "gradient_cosine": dot / max(norm * exact_norm, 1e-300),
        "gradient_norm_ratio": norm / max(exact_norm, 1e-300),
        "exact_reference": reference,
        "exact_converged": exact_converged,
        "exact_residual": residual,
        "exact_at_floor": not exact_converged and residual <= floor,
        "capped_solves": sum(not converged for *_, converged in solves) / len(solves),
        "max_iter": max(layer.max_iter for layer in layers),
    }


def reference_converged(layers: list[DEQ], reference: str) -> tuple[bool, float]:
    """Whether every solve of the last exact objective met its tolerance, and the largest relative residual: the
    forward solves, and an implicit reference's adjoint solves."""
    stats = [layer.stats for layer in layers]
    if reference == "implicit":
        stats += [s for layer in layers for s in layer.adjoint_stats.values()]
    return all(bool(s.converged) for s in stats), max(float(s.rel_residual) for s in stats)
