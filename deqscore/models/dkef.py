"""DKEF: deep kernel exponential family with a closed-form coefficient solve (docs/method.md sections 3.7, 4.2).

``log p~(x) = q0(x) + sum_j softmax(beta)_j sum_m alpha_m k_j(x, z_m)`` with ``q0(x) = -||x||^2 / (2 q0_std^2)``
and three Gaussian kernels ``k_j(x, z) = exp(-||phi_j(x) - phi_j(z)||^2 / (2 * 10^{l_j}))`` on learned features
``phi_j`` (a shallow MLP, a deep MLP or a DEQ, each plus a bias-free linear skip). The log-density is linear in
``alpha``, so every score-matching loss is quadratic in it: :meth:`DKEF.alpha_system` builds ``(G, b)`` and
:meth:`DKEF.solve_alpha` solves ``(G + 10^log_lambda I) alpha = -b``, differentiably, so that a loss measured on
other data trains the features, centres and kernel parameters through ``alpha`` (the two-stage scheme).

Derivatives of the kernels are taken in closed form from those of the features, which autograd computes once per
kernel with ``create_graph=True``. With ``r = phi(x) - phi(z_m)``, ``s = 10^l``, ``J = d phi / dx``:
``grad k = -(k/s) J^T r`` and ``lap k = (k/s^2) ||J^T r||^2 - (k/s) (||J||_F^2 + r . lap phi)``.

Cost of one alpha system, per feature net (three of them), besides one forward on the batch and one on the M
centres, in backward-pass equivalents on the batch (batched passes use ``is_grads_batched``): ``exact`` about
``1 + min(D, h) + 2 D`` (Jacobian columns, a D-batched Hessian trace for the Laplacian and a backward through it),
``sliced`` 4 whatever D, ``sliced_vr`` ``min(D, h) + 4``, ``dsm`` ``min(D, h) + 1``; the kernel algebra adds
``O(D B M h + D B M^2)``. A batched pass holds its batch size times the activations. The parameter gradient of a
loss through ``alpha`` (two-stage training) roughly doubles all of it. ``exact`` suits UCI sizes (D <= 15); for
large D use ``sliced``.

>>> import torch
>>> model = DKEF(dim=3, n_centres=8, hidden=6, feature_net="shallow").double()
>>> x = torch.randn(20, 3, dtype=torch.float64)
>>> model.init_centres(x)
>>> model.set_alpha(model.solve_alpha(x, "exact", create_graph=False))
>>> model.score(x[:4]).shape
torch.Size([4, 3])
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor, nn
from tqdm import tqdm

from ..deq import DEQ, DEQFactory, require_backward
from ..errors import ConfigError, check_count, check_real, choice_error
from ..losses.score_matching import PROJECTIONS, random_projections
from .dkef_features import (
    DKEFDEQMap,
    DKEFFeatureNet,
    _gauss_kernel,
    _KernelDerivs,
    _one_kernel_derivs,
    _weighted_sum,
    feature_derivatives,
)
from .dkef_partition import ImportanceProposal, _is_summary, effective_sample_size

__all__ = ["DKEF", "DKEFDEQMap", "DKEFFeatureNet", "ImportanceProposal", "effective_sample_size"]

DKEF_FEATURE_NETS = ("shallow", "deep", "deq")
ALPHA_OBJECTIVES = ("exact", "sliced", "sliced_vr", "dsm")
# the DSM system below is that of the sigma^4-weighted loss; the power of sigma that rescales it to each weighting
DSM_WEIGHTING_POWER = {"none": -4, "sigma2": -2, "sigma4": 0}
N_KERNELS = 3
BANDWIDTH_INITS = ("median", "fixed")
_DRAW_BLOCK = 1024  # proposal rows drawn per generator call: the samples do not depend on the chunk size


def _check_options(dim: int, n_centres: int, hidden: int, feature_net: str, deep_layers: int, q0_std: float,
                   log_lambda: float, kernel_log_scales: tuple[float, ...]) -> None:
    """Raise :class:`ConfigError` naming the first DKEF option out of range."""
    if feature_net not in DKEF_FEATURE_NETS:
        raise choice_error("DKEF feature_net", feature_net, DKEF_FEATURE_NETS)
    check_count("DKEF dim", dim)
    check_count("DKEF n_centres", n_centres)
    check_count("DKEF hidden", hidden)
    check_count("DKEF deep_layers", deep_layers, low=2, why=" (Linear layers of the deep feature net)")
    check_real("DKEF q0_std", q0_std)
    _check_finite("DKEF log_lambda", log_lambda)
    if not isinstance(kernel_log_scales, tuple | list) or len(kernel_log_scales) != N_KERNELS:
        raise ConfigError(f"DKEF kernel_log_scales must be {N_KERNELS} numbers, got {kernel_log_scales!r}")
    for value in kernel_log_scales:
        _check_finite("DKEF kernel_log_scales", value)


def _check_finite(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}", key=key.split()[-1])


def _init_normal_fan_out(module: nn.Module) -> None:
    """Weights and biases of every Linear layer ~ N(0, 1/fan_out) (the reference DKEF init)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            std = m.out_features**-0.5
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.normal_(m.bias, 0.0, std)


class DKEF(nn.Module):
    """Deep kernel exponential family (docs/method.md section 4.2); see the module docstring.

    Args:
        dim: data dimension D.
        n_centres: M, trainable kernel centres (call :meth:`init_centres` with training data).
        hidden: feature width h.
        feature_net: ``"shallow"``, ``"deep"`` or ``"deq"`` feature nets (one per kernel).
        deep_layers: Linear layers of a ``"deep"`` feature net.
        deq: the DEQ layer of a ``"deq"`` feature net, called with its fixed-point map (default: DEQ's own
            options); ``backward="ift"`` is refused, as every DKEF loss is second-order through the layer.
        grad_through_norm: differentiate the Frobenius normaliser ``w`` of the DEQ map.
        q0_std: standard deviation of the Gaussian base ``q0``.
        log_lambda: initial log10 ridge of the alpha solve (a trainable parameter).
        kernel_log_scales: initial ``l_j`` of the three kernels (trainable).
        bandwidth_init: ``"median"`` (default) makes :meth:`init_centres` shift each ``l_j`` by
            ``log10(median ||phi_j(x) - phi_j(z_m)||^2 / 2)`` over training points and centres, so that the
            kernels neither vanish nor saturate whatever the data dimension; ``"fixed"`` keeps ``10^l_j`` as
            given (the reference's widths, which vanish on whitened data from about D = 50 up).
        bandwidth_points: training rows the median is taken over (the first rows of ``x``).
    """

    def __init__(
        self,
        dim: int,  # data dimension D
        n_centres: int = 200,  # M trainable centres z_m
        hidden: int = 30,  # feature width h
        feature_net: Literal["shallow", "deep", "deq"] = "deq",  # feature network of each kernel
        deep_layers: int = 16,  # Linear layers of feature_net="deep"
        deq: DEQFactory | None = None,  # DEQ layer options (feature_net="deq"); None: DEQ's defaults
        grad_through_norm: bool = False,  # differentiate the DEQ map's Frobenius normaliser (reference: no)
        q0_std: float = 2.0,  # base density q0 = N(0, q0_std^2 I), unnormalised
        log_lambda: float = -2.0,  # initial log10 ridge of the alpha solve
        kernel_log_scales: tuple[float, float, float] = (0.0, 0.5185, 0.5185),  # initial l_j, bandwidth 10^l_j
        bandwidth_init: Literal["median", "fixed"] = "median",  # l_j shifted by the data's feature distances
        bandwidth_points: int = 1000,  # training rows the median feature distance is taken over
    ):
        super().__init__()
        _check_options(dim, n_centres, hidden, feature_net, deep_layers, q0_std, log_lambda, kernel_log_scales)
        if bandwidth_init not in BANDWIDTH_INITS:
            raise choice_error("DKEF bandwidth_init", bandwidth_init, BANDWIDTH_INITS)
        check_count("DKEF bandwidth_points", bandwidth_points)
        self.bandwidth_init, self.bandwidth_points = bandwidth_init, bandwidth_points
        self._given_log_scales = tuple(float(v) for v in kernel_log_scales)
        self.dim, self.n_centres, self.feature_net, self.q0_std = dim, n_centres, feature_net, float(q0_std)
        self.features = nn.ModuleList(
            DKEFFeatureNet(dim, hidden, feature_net, deep_layers, deq or DEQ, grad_through_norm)
            for _ in range(N_KERNELS)
        )
        _init_normal_fan_out(self.features)
        # alpha takes input derivatives of the kernels and every loss differentiates the score once more
        require_backward(self.features, order=3, user="DKEF (its alpha solve and losses)")
        self.centres = nn.Parameter(torch.randn(n_centres, dim))
        self.kernel_log_scales = nn.Parameter(torch.tensor([float(v) for v in kernel_log_scales]))
        self.beta = nn.Parameter(torch.zeros(N_KERNELS))
        self.log_lambda = nn.Parameter(torch.tensor(float(log_lambda)))
        self.register_buffer("alpha", torch.zeros(n_centres))

    # ---------------------------------------------------------------- inputs and coefficients

    def _check_x(self, x: Tensor, finite: bool = False) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != self.dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"DKEF expects inputs of shape [B, {self.dim}], got {shape}")
        if finite and not torch.isfinite(x).all():
            raise ValueError(f"the input to DKEF contains {int((~torch.isfinite(x)).sum())} non-finite values")
        return x

    def _alpha(self, alpha: Tensor | None) -> Tensor:
        alpha = self.alpha if alpha is None else alpha
        if alpha.shape != (self.n_centres,):
            raise ValueError(f"alpha must have shape [{self.n_centres}] (one per centre), got {tuple(alpha.shape)}")
        return alpha

    @torch.no_grad()
    def init_centres(self, x: Tensor, generator: torch.Generator | None = None) -> None:
        """Set the centres to ``n_centres`` distinct random rows of the training data ``x`` and, with
        ``bandwidth_init="median"``, the kernel widths from the feature distances between ``x`` and the centres."""
        self._check_x(x, finite=True)
        if x.shape[0] < self.n_centres:
            raise ValueError(f"init_centres needs at least n_centres={self.n_centres} rows, got {x.shape[0]}")
        idx = torch.randperm(x.shape[0], generator=generator, device=generator.device if generator else "cpu")
        self.centres.copy_(x[idx[: self.n_centres].to(x.device)])
        if self.bandwidth_init == "median":
            self.init_bandwidths(x[: self.bandwidth_points])

    @torch.no_grad()
    def init_bandwidths(self, x: Tensor) -> None:
        """Median heuristic: ``l_j = l_j(given) + log10(median ||phi_j(x) - phi_j(z_m)||^2 / 2)``, so that a point
        at the median feature distance from a centre has ``k_j = exp(-10^-l_j(given))`` (``exp(-1)`` at 0).
        Idempotent: the shift is always applied to the widths given at construction."""
        given = torch.tensor(self._given_log_scales, dtype=self.kernel_log_scales.dtype)
        for j, phi in enumerate(self.features):
            sq = torch.cdist(phi(self._check_x(x)), phi(self.centres)).pow(2)
            given[j] += math.log10(max(sq.median().item(), 1e-12) / 2)
        self.kernel_log_scales.copy_(given)

    @torch.no_grad()
    def set_alpha(self, alpha: Tensor) -> None:
        """Store ``alpha`` (detached) as the model's current coefficients, used when ``alpha`` is not given."""
        alpha = self._alpha(alpha)
        if not torch.isfinite(alpha).all():
            raise ValueError("set_alpha: alpha contains non-finite values")
        self.alpha.copy_(alpha.detach())

    # ---------------------------------------------------------------- density

    def q0(self, x: Tensor) -> Tensor:
        """Unnormalised Gaussian base ``-||x||^2 / (2 q0_std^2)``, [B]."""
        return -x.pow(2).sum(1) / (2 * self.q0_std**2)

    def _centre_features(self) -> list[Tensor]:
        return [phi(self.centres) for phi in self.features]

    def _kernel(self, x: Tensor, centre_feats: list[Tensor]) -> Tensor:
        weights, scales = torch.softmax(self.beta, 0), 10**self.kernel_log_scales
        parts = [_gauss_kernel(phi(x), c, s) for phi, c, s in zip(self.features, centre_feats, scales, strict=True)]
        return _weighted_sum(parts, weights)

    def kernel(self, x: Tensor) -> Tensor:
        """Kernel mixture ``k(x)_m = sum_j softmax(beta)_j k_j(x, z_m)`` against the centres, [B, M]."""
        return self._kernel(self._check_x(x), self._centre_features())

    def log_density(self, x: Tensor, alpha: Tensor | None = None) -> Tensor:
        """Unnormalised ``log p~(x) = q0(x) + k(x) . alpha``, [B] (``alpha``: the stored one by default)."""
        alpha = self._alpha(alpha)
        return self.q0(x) + self.kernel(x) @ alpha

    def score(self, x: Tensor, alpha: Tensor | None = None) -> Tensor:
        """``grad_x log p~(x)`` [B, D] by autograd. Differentiable (``create_graph``) when grad mode is on; an
        ``x`` that requires grad is differentiated as given, so losses can take its derivative in turn."""
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            xg = x if x.requires_grad else x.detach().requires_grad_(True)
            (s,) = torch.autograd.grad(self.log_density(xg, alpha).sum(), xg, create_graph=create_graph)
        return s

    def log_likelihood(self, x: Tensor, log_Z: float | Tensor, alpha: Tensor | None = None) -> Tensor:
        """Normalised log-density ``log p~(x) - log Z`` [B], ``log_Z`` from :meth:`log_partition`."""
        return self.log_density(x, alpha) - log_Z

    # ---------------------------------------------------------------- alpha solve

    def _kernel_derivs(self, x: Tensor, cols: bool, lap: bool, v: Tensor | None) -> _KernelDerivs:
        weights, scales = torch.softmax(self.beta, 0), 10**self.kernel_log_scales
        per_kernel = []
        for phi, s in zip(self.features, scales, strict=True):
            per_kernel.append(_one_kernel_derivs(feature_derivatives(phi, x, cols, lap, v), phi(self.centres), s))
        return _KernelDerivs(*(_weighted_sum([kd[i] for kd in per_kernel], weights) for i in range(4)))

    def _draws(self, x: Tensor, objective: str, sigma: float | None, projection: str, projections: Tensor | None,
               noise: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """The projections ``v`` (sliced objectives) and the noise ``eps`` (dsm), given or drawn, checked."""
        v = eps = None
        if objective in ("sliced", "sliced_vr"):
            if projection not in PROJECTIONS:
                raise choice_error("DKEF projection", projection, PROJECTIONS)
            v = random_projections(x, projection) if projections is None else projections
        if objective == "dsm":
            if sigma is None:
                raise ValueError("DKEF alpha_system: objective 'dsm' needs sigma (the noise level)")
            check_real("DKEF dsm sigma", sigma, error=ValueError)
            eps = torch.randn_like(x) if noise is None else noise
        for name, t in (("projections", v), ("noise", eps)):
            if t is not None and t.shape != x.shape:
                raise ValueError(f"DKEF {name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
        return v, eps

    def alpha_system(
        self,
        x: Tensor,
        objective: Literal["exact", "sliced", "sliced_vr", "dsm"],
        sigma: float | None = None,
        projection: str = "gaussian",
        create_graph: bool = True,
        *,
        projections: Tensor | None = None,
        noise: Tensor | None = None,
        dsm_weighting: str = "sigma4",
        chunk: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(G [M, M], b [M])`` of the loss ``0.5 a^T G a + b^T a + const`` (docs/method.md section 3.7).

        ``exact``: ``G = E[grad k grad k^T]``, ``b = E[lap k + grad k grad q0]``. ``sliced``:
        ``G = E[(grad k v)(grad k v)^T]``, ``b = E[v^T hess k v + (grad k v)(v . grad q0)]``, one ``v`` per sample
        (``projection`` kind, or ``projections`` [B, D] given). ``sliced_vr`` (SSM-VR loss
        ``0.5 ||s||^2 + v^T grad s v``): exact G, ``b = E[v^T hess k v + grad k grad q0]``. ``dsm`` (sigma^4
        weighting, ``x~ = x + n``, ``n = sigma eps``, ``eps`` drawn or ``noise``): ``G = sigma^4 E[grad k grad k^T]``,
        ``b = sigma^2 E[grad k (sigma^2 grad q0 + n)]``, all at ``x~``; ``dsm_weighting`` (``none``, ``sigma2``)
        rescales it to the system of that weighting of the loss, so alpha minimises the very loss that is trained.
        Expectations are batch means. With ``create_graph`` the results are differentiable in every parameter;
        otherwise they are detached, and with ``chunk`` the means are accumulated over chunks of that many rows (the
        kernel derivatives of a chunk are ``chunk x D x M``: all rows at once may not fit in memory).
        """
        if objective not in ALPHA_OBJECTIVES:
            raise choice_error("DKEF alpha objective", objective, ALPHA_OBJECTIVES)
        if dsm_weighting not in DSM_WEIGHTING_POWER:
            raise choice_error("DKEF alpha dsm_weighting", dsm_weighting, tuple(DSM_WEIGHTING_POWER))
        if not create_graph and chunk and len(x) > chunk and projections is None and noise is None:
            parts = [(len(part), self.alpha_system(part, objective, sigma, projection, False,
                                                   dsm_weighting=dsm_weighting)) for part in x.split(chunk)]
            return (sum(n * gb[0] for n, gb in parts) / len(x), sum(n * gb[1] for n, gb in parts) / len(x))
        x = self._check_x(x, finite=True).detach()
        v, eps = self._draws(x, objective, sigma, projection, projections, noise)
        with torch.enable_grad():
            if eps is not None:
                x = x + sigma * eps
            x = x.requires_grad_(True)
            kd = self._kernel_derivs(x, cols=objective != "sliced", lap=objective == "exact", v=v)
            gram, b = self._assemble(objective, x, kd, v, sigma, eps)
        if objective == "dsm" and dsm_weighting != "sigma4":
            scale = sigma ** DSM_WEIGHTING_POWER[dsm_weighting]
            gram, b = gram * scale, b * scale
        return (gram, b) if create_graph else (gram.detach(), b.detach())

    def _assemble(self, objective: str, x: Tensor, kd: _KernelDerivs, v: Tensor | None, sigma: float | None,
                  eps: Tensor | None) -> tuple[Tensor, Tensor]:
        n = x.shape[0]
        grad_q0 = -x.detach() / self.q0_std**2  # [B, D]
        if objective == "sliced":
            gram = kd.gv.T @ kd.gv / n
            return gram, (kd.vhv + kd.gv * (v * grad_q0).sum(1, keepdim=True)).mean(0)
        gram = torch.einsum("dbm,dbn->mn", kd.grad, kd.grad) / n
        if objective == "exact":
            return gram, (kd.lap + torch.einsum("dbm,bd->bm", kd.grad, grad_q0)).mean(0)
        if objective == "sliced_vr":
            return gram, (kd.vhv + torch.einsum("dbm,bd->bm", kd.grad, grad_q0)).mean(0)
        target = sigma**2 * grad_q0 + sigma * eps  # dsm
        return sigma**4 * gram, sigma**2 * torch.einsum("dbm,bd->m", kd.grad, target) / n

    def solve_alpha(
        self,
        x: Tensor,
        objective: Literal["exact", "sliced", "sliced_vr", "dsm"],
        sigma: float | None = None,
        projection: str = "gaussian",
        create_graph: bool = True,
        *,
        projections: Tensor | None = None,
        noise: Tensor | None = None,
        dsm_weighting: str = "sigma4",
        chunk: int | None = None,
    ) -> Tensor:
        """``alpha`` [M] solving ``(G + 10^log_lambda I) alpha = -b`` (:meth:`alpha_system`), differentiable in
        the parameters (``log_lambda`` included) when ``create_graph``. A singular system raises ValueError."""
        gram, b = self.alpha_system(x, objective, sigma, projection, create_graph, projections=projections,
                                    noise=noise, dsm_weighting=dsm_weighting, chunk=chunk)
        return self.alpha_from_system(gram, b, differentiable=create_graph)

    def alpha_from_system(self, gram: Tensor, b: Tensor, differentiable: bool = True) -> Tensor:
        """Solve ``(gram + 10^log_lambda I) alpha = -b`` for a system from :meth:`alpha_system` (e.g. one kept
        fixed while only ``log_lambda`` is tuned); differentiable in ``log_lambda`` when ``differentiable``.
        Raises ValueError naming ``log_lambda`` when the system is singular or the solution not finite."""
        if gram.shape != (self.n_centres, self.n_centres) or b.shape != (self.n_centres,):
            raise ValueError(f"alpha system must be G [{self.n_centres}, {self.n_centres}] and b "
                             f"[{self.n_centres}], got {tuple(gram.shape)} and {tuple(b.shape)}")
        log_lambda = self.log_lambda if differentiable else self.log_lambda.detach()
        if gram.dtype in (torch.float16, torch.bfloat16):  # under autocast: no half-precision LU, solve in float32
            gram, b = gram.float(), b.float()
        eye = torch.eye(self.n_centres, dtype=gram.dtype, device=gram.device)
        with torch.autocast(gram.device.type, enabled=False):
            alpha, info = torch.linalg.solve_ex(gram + 10**log_lambda * eye, -b)
        if int(info) != 0 or not torch.isfinite(alpha).all():
            raise ValueError(
                f"DKEF alpha solve failed: G + 10^log_lambda I is singular or ill-conditioned (log_lambda = "
                f"{log_lambda.item():.4g}); increase log_lambda (a larger ridge), or check for duplicated centres"
            )
        return alpha

    # ---------------------------------------------------------------- normaliser

    def _proposal_chunks(self, n: int, chunk: int, proposal: ImportanceProposal,
                         gen: torch.Generator | None) -> Iterator[Tensor]:
        """Draws of ``proposal``, ``chunk`` rows at a time; drawn in fixed blocks, so independent of ``chunk``."""
        dev = self.centres.device if gen is None else gen.device
        buf = torch.empty(0, self.dim, dtype=self.centres.dtype, device=dev)
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            while buf.shape[0] < size:
                buf = torch.cat([buf, proposal.draw(_DRAW_BLOCK, gen, buf.dtype, dev)])
            rows, buf = buf[:size], buf[size:]
            yield rows.to(self.centres.device)

    @torch.no_grad()
    def log_partition(
        self,
        alpha: Tensor | None = None,
        n_samples: int = 10**6,
        chunk: int = 10**4,
        proposal_std: float = 2.0,
        generator: torch.Generator | None = None,
        progress: bool = False,
        proposal_points: Tensor | None = None,
    ) -> tuple[float, float]:
        """Importance-sampling estimate ``(log Z, stderr)`` with proposal ``q = N(0, proposal_std^2 I)``, or with
        ``proposal_points`` the defensive mixture of :class:`ImportanceProposal` (half that Gaussian, half
        Gaussians at the points: the data's own regions are drawn often, the tails still covered).

        ``log Z = logsumexp_i(log p~(x_i) - log q(x_i)) - log N``, in chunks of ``chunk`` rows (memory
        ``chunk x M``), sums kept as running logsumexps in float64. ``stderr`` is the delta-method standard error
        ``sqrt(var(w) / N) / mean(w) = sqrt((N / ESS - 1) / (N - 1))``, ``ESS = (sum w)^2 / sum w^2``. Warns when
        ESS < 100 or stderr > 0.1. The samples depend on ``generator`` and ``n_samples``, not on ``chunk``.
        """
        check_count("log_partition n_samples", n_samples, low=2, error=ValueError)
        check_count("log_partition chunk", chunk, error=ValueError)
        check_real("log_partition proposal_std", proposal_std, error=ValueError)
        alpha, centre_feats = self._alpha(alpha), self._centre_features()
        proposal = ImportanceProposal(self.dim, proposal_std, proposal_points)
        s1 = s2 = torch.tensor(-math.inf, dtype=torch.float64, device=alpha.device)
        chunks = self._proposal_chunks(n_samples, chunk, proposal, generator)
        for x in tqdm(chunks, total=math.ceil(n_samples / chunk), disable=not progress, desc="DKEF log Z"):
            log_p = self.q0(x) + self._kernel(x, centre_feats) @ alpha
            log_w = (log_p - proposal.log_prob(x)).double()
            s1 = torch.logaddexp(s1, torch.logsumexp(log_w, 0))
            s2 = torch.logaddexp(s2, torch.logsumexp(2 * log_w, 0))
        return _is_summary(float(s1), float(s2), n_samples)
