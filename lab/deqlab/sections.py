"""The benchmark sections, each returning a :class:`~deqlab.report.Table`; the family sections (``nice``,
``dkef``, ``ncsn``, ``vae``) are their own modules."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deqscore.deq import DEQ
from deqscore.deq.solvers import get_solver, picard
from deqscore.families import declarations
from deqscore.models import DEQMNet, explicit_mlp

from .depth import depth as depth_section
from .families import family_file
from .implicit import section as implicit_section
from .measure import CouplingDensity, log, make_inputs, measure_step, ssm_loss, timed
from .report import Column, Table
from .settings import FORCED_TOL, MAIN_SOLVER_BLOCK, RANDOM_INIT_BLOCK, SOLVERS, Settings


def _step_columns(device: torch.device) -> list[Column]:
    cols = [Column("act_mib", "activation memory (MiB)", ".2f")]
    if device.type == "cuda":
        cols.append(Column("peak_mib", "CUDA peak (MiB)", ".1f"))
    return cols + [Column("time_ms", "step time (ms)", ".1f"), Column("repeats", "timed steps")]


def _deq_net(d_in: int, hidden: int, **deq_kwargs) -> DEQMNet:
    return DEQMNet(d_in, hidden, d_in, deq=partial(DEQ, solver="picard", warn_on_nonconvergence=False, **deq_kwargs))


# ---------------------------------------------------------------- 1. memory_vs_iterations


def _memory_models(s: Settings) -> list[tuple[str, int, nn.Module]]:
    """(model, iterations or depth, m-net) for every row."""
    rows: list[tuple[str, int, nn.Module]] = []
    for mode in ("phantom", "unroll", "implicit"):
        for n in s.mem_iterations:
            kw = {"phantom_steps": s.mem_phantom_steps} if mode == "phantom" else {}
            torch.manual_seed(s.seed)
            rows.append((mode, n, _deq_net(s.mem_d_in, s.mem_hidden, max_iter=n, tol=FORCED_TOL, backward=mode, **kw)))
    for depth in s.mem_depths:
        torch.manual_seed(s.seed)
        rows.append(("explicit MLP", depth, explicit_mlp(s.mem_d_in, s.mem_hidden, depth + 2, s.mem_d_in)))
    return rows


def memory_vs_iterations(s: Settings, device: torch.device) -> Table:
    x, source = make_inputs(s.mem_batch, 2 * s.mem_d_in, s, device, torch.float32)
    table = Table("memory_vs_iterations", "1. Activation memory vs solver iterations (one SSM step)", [
        Column("model", "model"), Column("n", "iterations / depth"), Column("solver_iters", "solver iterations run"),
        *_step_columns(device),
    ])
    for name, n, m_net in _memory_models(s):
        density = CouplingDensity(m_net).to(device)
        res = measure_step(lambda d=density: ssm_loss(d, x), density, device, s)
        iters = m_net.deq.stats.nstep if isinstance(m_net, DEQMNet) else None
        table.rows.append({"model": name, "n": n, "solver_iters": iters, **vars(res)})
        log(f"memory: {name} n={n}: {res.act_mib:.2f} MiB, {res.time_ms:.1f} ms ({res.repeats} steps)")
    table.notes += [
        f"One coupling `log p(x) = -0.5||x1||^2 - 0.5||x2 - m(x1)||^2`, m = DEQ block (input {s.mem_d_in}, hidden "
        f"{s.mem_hidden}, `DEQMNet`) or explicit Softplus MLP {s.mem_d_in} -> {s.mem_hidden} x (depth+1) -> "
        f"{s.mem_d_in} (depth = hidden {s.mem_hidden}x{s.mem_hidden} layers); batch {s.mem_batch}, float32, "
        f"inputs {source}. Step = `sliced_score_matching(score_from_log_prob(logp), x).mean().backward()`.",
        f"DEQ rows: Picard forced to exactly N iterations (tol {FORCED_TOL:g}); `phantom` runs them under no_grad "
        f"and re-attaches K={s.mem_phantom_steps} steps, `unroll` records every iteration, `implicit` (the exact "
        "backward of every order, docs/method.md 2.9) runs them and its adjoint solves without a graph.",
        "Activation memory: distinct storages autograd saves in the step's forward and backward "
        "(`loss_step_bytes`), parameters excluded.",
    ]
    return table


# ---------------------------------------------------------------- 2. phantom_fidelity


def _flat_grad(density: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    """Parameter gradient of the mean SSM loss, with the projection vectors drawn from ``seed``."""
    density.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    ssm_loss(density, x).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in density.parameters()])


def _configure(deq: nn.Module, **attrs: object) -> None:
    for key, value in attrs.items():
        setattr(deq, key, value)


def _spectral_norm(m_net: DEQMNet, x1: torch.Tensor, s: Settings) -> tuple[float, float]:
    """Spectral norm of ``dF/dz`` at the fixed point (power iteration per sample, max over the batch) and the
    Picard residual ratio (geometric mean of the first contraction steps)."""
    with torch.no_grad():
        u = F.softplus(m_net.inject(x1))
        z, stats = picard(lambda z: m_net.deq.func(z, u), torch.zeros_like(u), tol=FORCED_TOL, max_iter=s.fid_ref_iters)
        fn = lambda z: m_net.deq.func(z, u)  # noqa: E731
        _, vjp_fn = torch.func.vjp(fn, z)
        v = torch.randn_like(z)
        sigma2 = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
        for _ in range(s.fid_power_iters):
            v = v / v.norm(dim=1, keepdim=True)
            (jtjv,) = vjp_fn(torch.func.jvp(fn, (z,), (v,))[1])
            sigma2, v = (v * jtjv).sum(1), jtjv
    return sigma2.sqrt().max().item(), _picard_ratio(stats.history)


def _picard_ratio(history: list[float], n_first: int = 5) -> float:
    """Geometric mean of the first residual ratios above the rounding floor."""
    h = [r for r in history if r > 1e-12 * history[0]][: n_first + 1]
    if len(h) < 2:
        return 0.0
    return (h[-1] / h[0]) ** (1 / (len(h) - 1))


def _compare(g: torch.Tensor, g_ref: torch.Tensor) -> tuple[float, float]:
    cos = torch.nn.functional.cosine_similarity(g, g_ref, dim=0).item()
    return cos, ((g - g_ref).norm() / g_ref.norm()).item()


def phantom_fidelity(s: Settings, device: torch.device) -> Table:
    dtype = torch.float64
    x, source = make_inputs(s.fid_batch, 2 * s.fid_d_in, s, device, dtype)
    torch.manual_seed(s.seed)
    m_net = _deq_net(s.fid_d_in, s.fid_hidden, max_iter=s.fid_ref_iters, tol=FORCED_TOL)
    density = CouplingDensity(m_net).to(device, dtype)
    _configure(m_net.deq, backward="unroll")
    g_ref = _flat_grad(density, x, s.seed)
    sigma, ratio = _spectral_norm(m_net, x[:, 0::2], s)
    table = Table("phantom_fidelity", "2. Phantom-gradient fidelity vs the exact (unrolled) SSM gradient", [
        Column("variant", "re-attachment"), Column("K", "K"), Column("cosine", "cosine similarity", ".12f"),
        Column("rel_error", "relative error", ".3e"), Column("sigma_K", "sigma^K (contraction^K)", ".3e"),
    ])
    variants = [("phantom", k, False) for k in s.fid_steps] + [("phantom + injection pre-step (REF)", 1, True)]
    for name, k, prestep in variants:
        _configure(m_net.deq, backward="phantom", phantom_steps=k, injection_prestep=prestep)
        cos, err = _compare(_flat_grad(density, x, s.seed), g_ref)
        table.rows.append({"variant": name, "K": k, "cosine": cos, "rel_error": err, "sigma_K": sigma**k})
        log(f"fidelity: {name} K={k}: cosine {cos:.12f}, rel. error {err:.3e}")
    table.notes += [
        f"Same coupling density as section 1 with a DEQ block (input {s.fid_d_in}, hidden {s.fid_hidden}), batch "
        f"{s.fid_batch}, float64, inputs {source}, random init (seed {s.seed}); every gradient uses the same "
        "Rademacher projections (reseeded).",
        f"Exact gradient: `backward='unroll'`, {s.fid_ref_iters} Picard iterations at tol {FORCED_TOL:g}. Phantom "
        f"rows: the same {s.fid_ref_iters}-iteration solve under no_grad, then K differentiable steps.",
        f"Contraction of the block at init: spectral norm of dF/dz at z* (max over samples, {s.fid_power_iters} "
        f"power iterations) sigma = {sigma:.3e}; Picard residual ratio {ratio:.3e}. The error should fall "
        "roughly like sigma^K; once the omitted Neumann terms drop below double precision, the phantom and the "
        "unrolled gradient come from the same final steps and agree to rounding.",
    ]
    table.meta.update(sigma=sigma, picard_ratio=ratio)
    return table


# ---------------------------------------------------------------- 3. solvers


def _stress(m_net: DEQMNet, bias: float, seed: int) -> None:
    """Rank-1 weights ``W1 = a b^T``, ``W2 = b a^T`` and positive biases: ``||W||_2 = ||W||_F`` and Softplus'
    close to 1, so the map's contraction approaches its bound ``a = 0.5``."""
    gen = torch.Generator().manual_seed(seed)
    f = m_net.deq.func
    a, b = (torch.randn(f.lin1.in_features, generator=gen).abs() for _ in range(2))
    with torch.no_grad():
        f.lin1.weight.copy_(torch.outer(a, b))
        f.lin2.weight.copy_(torch.outer(b, a))
        f.lin1.bias.fill_(bias)
        f.lin2.bias.fill_(bias)


def _solve(m_net: DEQMNet, u: torch.Tensor, name: str, stop: str, tol: float, max_iter: int):
    f = lambda z: m_net.deq.func(z, u)  # noqa: E731
    return get_solver(name)(f, torch.zeros_like(u), tol=tol, max_iter=max_iter, stop_mode=stop, per_sample=False)


def _solver_rows(block: str, m_net: DEQMNet, u: torch.Tensor, s: Settings, device: torch.device) -> list[dict]:
    rows = []
    for stop, tol in s.sol_tolerances:
        picard_steps = None
        for name in SOLVERS:
            solve = partial(_solve, m_net, u, name, stop, tol, s.sol_max_iter)
            (_, st), ms, n = timed(solve, device, s)
            picard_steps = st.nstep if name == "picard" else picard_steps
            rows.append({
                "block": block, "tolerance": f"{stop} {tol:g}", "solver": name, "fevals": st.nstep,
                "converged": st.converged, "abs_residual": st.abs_residual, "rel_residual": st.rel_residual,
                "time_ms": ms, "repeats": n, "vs_picard": st.nstep / picard_steps,
            })
            log(f"solvers: {block} {stop} {tol:g} {name}: {st.nstep} fevals, converged {st.converged}, {ms:.1f} ms")
    return rows


def _solver_block(kind: str, dtype: torch.dtype, s: Settings, device: torch.device) -> tuple[DEQMNet, torch.Tensor]:
    """The block (random init or stress) in ``dtype`` and its injection ``u`` for the benchmark inputs."""
    x, _ = make_inputs(s.sol_batch, 2 * s.sol_d_in, s, device, dtype)
    torch.manual_seed(s.seed)
    m_net = _deq_net(s.sol_d_in, s.sol_hidden)
    if kind == "stress":
        _stress(m_net, s.sol_stress_bias, s.seed)
    m_net = m_net.to(device, dtype)
    with torch.no_grad():
        return m_net, F.softplus(m_net.inject(x[:, 0::2]))


def _trained_blocks(s: Settings, device: torch.device) -> list[tuple[DEQMNet, torch.Tensor]]:
    """The DEQ m-nets of a trained NICE checkpoint with their injections for the benchmark batch."""
    from deqscore.lightning import load_module

    flow = load_module(s.trained_checkpoint).net.to(device)
    if not all(isinstance(m, DEQMNet) for m in flow.m_nets):
        raise ValueError(f"{s.trained_checkpoint} is not a DEQ-NICE checkpoint (its m-nets are not DEQs)")
    x, _ = make_inputs(s.sol_batch, flow.dim, s, device, torch.float32)
    inputs: list[torch.Tensor] = []  # each m-net's input, recorded during the flow's own forward pass
    hooks = [m.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for m in flow.m_nets]
    try:
        with torch.no_grad():
            flow(x)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        return [(m_net, F.softplus(m_net.inject(inp))) for m_net, inp in zip(flow.m_nets, inputs, strict=True)]


def _solver_notes(s: Settings, rows: list[dict], source: str) -> list[str]:
    main = [r for r in rows if r["block"] == RANDOM_INIT_BLOCK and r["solver"] == "picard"]
    norm_f = main[0]["abs_residual"] / main[0]["rel_residual"]
    picard = ", ".join(f"{r['fevals']} ({r['tolerance']})" for r in main)
    eps = torch.finfo(torch.float32).eps
    rel_ref = s.sol_tolerances[0][1] / norm_f
    stalled = [f"{r['block']} / {r['tolerance']} / {r['solver']}" for r in rows if not r["converged"]]
    return [
        f"Block: `DEQMNet` input {s.sol_d_in}, hidden {s.sol_hidden}; batch {s.sol_batch}, inputs {source}; start "
        f"z0 = 0, max_iter {s.sol_max_iter}; function evaluations = `stats.nstep`; stopping on the whole-batch L2 "
        "residual ||F(z) - z||, absolute (reference: 2e-5, NICE) or divided by ||F(z)|| (rel).",
        f"Random init, float32: Picard's function evaluations {picard}. The Frobenius normalisation makes the map "
        "contract far more strongly than its bound a = 0.5 (spectral << Frobenius norm for random square weights; "
        "sigma in section 2), so at init there is little for acceleration to gain.",
        f"||F(z*)|| = {norm_f:.3g} over the batch, so abs {s.sol_tolerances[0][1]:g} is a relative {rel_ref:.1e} "
        f"= {rel_ref / eps:.2g} x float32 eps ({eps:.1e}). Anderson therefore mixes its iterates as a correction of "
        "the last image (a plain weighted sum of images carries rounding error ~eps ||z|| and stalls above such a "
        "tolerance); the float64 rows separate rounding from the algorithm.",
        "Not converged (max_iter hit): " + ("; ".join(stalled) if stalled else "none") + ".",
        f"The stress block is constructed, not trained: rank-1 weights W1 = a b^T, W2 = b a^T (spectral = "
        f"Frobenius norm) and biases +{s.sol_stress_bias:g}, so the contraction approaches a = 0.5; it shows "
        f"where Anderson/Broyden acceleration matters, and target (c) is judged on it ({MAIN_SOLVER_BLOCK}).",
    ]


def solvers(s: Settings, device: torch.device) -> Table:
    table = Table("solvers", "3. Forward solvers on the NICE m-net DEQ block (no grad)", [
        Column("block", "block"), Column("tolerance", "tolerance (whole batch)"), Column("solver", "solver"),
        Column("fevals", "function evaluations"), Column("vs_picard", "fevals / Picard's", ".2f"),
        Column("converged", "converged"), Column("abs_residual", "abs residual", ".2e"),
        Column("rel_residual", "rel residual", ".2e"), Column("time_ms", "time (ms)", ".1f"),
        Column("repeats", "timed solves"),
    ])
    for kind, dtype_name in s.sol_blocks:
        m_net, u = _solver_block(kind, getattr(torch, dtype_name), s, device)
        with torch.no_grad():
            table.rows += _solver_rows(f"{kind}, {dtype_name}", m_net, u, s, device)
    if s.trained_checkpoint:
        for i, (m_net, u) in enumerate(_trained_blocks(s, device)):
            with torch.no_grad():
                table.rows += _solver_rows(f"trained, coupling {i}, float32", m_net, u, s, device)
        table.notes.append(f"Trained blocks: the DEQ m-nets of `{s.trained_checkpoint}`, each fed the MNIST-test "
                           "batch as it arrives at that coupling.")
    _, source = make_inputs(1, 2 * s.sol_d_in, s, device, torch.float32)
    table.notes += _solver_notes(s, table.rows, source)
    return table


GENERIC_SECTIONS = {
    "memory_vs_iterations": memory_vs_iterations,
    "phantom_fidelity": phantom_fidelity,
    "solvers": solvers,
}


#: the sections over every declared family's depth entry
ACROSS_FAMILIES = {"depth": depth_section, "implicit": implicit_section}


def section_funcs() -> dict:
    """Every section by name: the DEQ layer's generic ones, each declared family's (its laboratory file's
    ``section``, :mod:`deqlab.families`), and the sections across every family (depth, implicit)."""
    files = {name: family_file(name) for name in declarations()}
    families = {name: file.section for name, file in files.items() if hasattr(file, "section")}
    return {**GENERIC_SECTIONS, **families, **ACROSS_FAMILIES}
