"""NICE density estimation (MNIST) trained by MLE or any score-matching loss.

Data come in logit space (see :mod:`deqscore.data.transforms`); validation and test report the model's
log-likelihood in logit space (nats, as the reference code) and in bits/dim of the 8-bit pixels (logit
Jacobian and dequantisation included), and the exact score-matching loss.
"""

from __future__ import annotations

import torch

from ..data.transforms import bits_per_dim, inverse_logit
from ..deq import deq_backward
from ..losses import SCORE_LOSSES, exact_score_matching, make_score_loss, score_from_log_prob
from ..losses.approx_backprop import curvature_propagation_score_matching, kingma_score_matching
from ..models import NICE
from .base import ScoreModule

NICE_LOSSES = (*SCORE_LOSSES, "mle", "kingma", "cp")


class NICEModule(ScoreModule):
    """LightningModule around :class:`deqscore.models.NICE`."""

    family = "nice"

    def __init__(
        self,
        # ---- network (METHOD.md 4.1) ----
        dim: int = 784,  # data dimension
        n_couplings: int = 4,  # additive couplings (the reference code uses 2)
        m_net: str = "deq",  # "explicit" (5-layer MLP) or "deq"
        hidden: int = 1000,  # m-net width
        n_layers: int = 5,  # Linear layers of an explicit m-net
        deq_scale: float = 0.5,  # contraction factor a of the DEQ map
        grad_through_norm: bool = True,  # differentiate the DEQ map's Frobenius normaliser (reference: yes)
        # ---- DEQ solver and backward ----
        solver: str = "picard",  # picard | anderson | broyden | a registered name
        max_iter: int = 128,  # forward solver iterations cap
        tol: float = 2e-5,  # stopping tolerance (reference: absolute whole-batch L2, 2e-5)
        stop_mode: str = "abs",  # "abs" or "rel" residual
        per_sample: bool = False,  # stop per sample instead of on the whole batch
        backward: str = "phantom",  # phantom | unroll | ift (ift refuses second-order losses)
        phantom_steps: int = 2,  # K differentiable steps after the solve (paper: 2; reference code: 1)
        phantom_damping: float = 1.0,  # lambda of the phantom steps
        injection_prestep: bool = False,  # the reference code's injection-only pre-step
        warm_start: bool = True,  # reuse the last fixed point for same-shape inputs
        # ---- loss ----
        loss: str = "ssm",  # exact | ssm | ssm_vr | dsm | mle | kingma | cp
        n_projections: int = 1,  # SSM projections per sample
        projection: str = "rademacher",  # rademacher | gaussian | sphere
        dsm_sigma: float = 0.16,  # DSM noise level
        dsm_scaling: str = "sigma2",  # sigma2 (standard) | sigma4 (reference code)
        # ---- evaluation ----
        exact_sm_batches: int = 1,  # val/test batches on which exact SM is computed (-1: all); D backward passes each
        exact_sm_samples: int | None = None,  # at most this many samples of such a batch (None: all)
        # ---- optimiser ----
        optimizer: str = "adam",  # adam | sgd | rmsprop
        lr: float = 1e-4,  # learning rate
        weight_decay: float = 0.0,
    ):
        super().__init__(lr=lr, weight_decay=weight_decay, optimizer=optimizer)
        self.save_hyperparameters()
        if loss not in NICE_LOSSES:
            raise ValueError(f"unknown NICE loss {loss!r}; choose one of {NICE_LOSSES}")
        if loss in ("kingma", "cp") and m_net != "explicit":
            raise ValueError(f"loss {loss!r} (approximate backprop) works only with m_net='explicit'")
        if exact_sm_samples is not None and exact_sm_samples < 1:
            raise ValueError(f"exact_sm_samples must be >= 1 or None, got {exact_sm_samples}")
        if backward == "ift" and m_net == "deq" and loss != "mle":
            raise ValueError(
                f"backward='ift' gives wrong parameter gradients for the second-order loss {loss!r} (its input "
                "gradient is differentiated again); use backward='phantom' or 'unroll', or loss='mle'"
            )
        self.net = NICE(
            dim=dim, n_couplings=n_couplings, m_net=m_net, hidden=hidden, n_layers=n_layers, deq_scale=deq_scale,
            grad_through_norm=grad_through_norm, solver=solver, max_iter=max_iter, tol=tol, stop_mode=stop_mode,
            per_sample=per_sample, backward=backward, phantom_steps=phantom_steps, phantom_damping=phantom_damping,
            injection_prestep=injection_prestep, warm_start=warm_start,
        )
        self.loss_name = loss
        self.exact_sm_batches, self.exact_sm_samples = exact_sm_batches, exact_sm_samples
        # built (and its options checked) whatever the loss, so a typo in an unused option still fails early
        self._score_loss = make_score_loss(
            loss if loss in SCORE_LOSSES else "exact", n_projections=n_projections, projection=projection,
            dsm_sigma=dsm_sigma, dsm_scaling=dsm_scaling,
        )

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """Model score ``grad_x log p(x)`` (x must require grad)."""
        return score_from_log_prob(self.net.log_prob)(x)

    def compute_loss(self, x: torch.Tensor) -> torch.Tensor:
        if self.loss_name == "mle":
            return -self.net.log_prob(x)
        if self.loss_name == "kingma":
            return kingma_score_matching(self.net, x)
        if self.loss_name == "cp":
            return curvature_propagation_score_matching(self.net, x)
        return self._score_loss(self.score, x)

    def eval_metrics(self, x: torch.Tensor, stage: str, batch_idx: int) -> dict[str, torch.Tensor]:
        logp = self.net.log_prob(x).detach()
        metrics = {"log_likelihood": logp.mean(), "bits_per_dim": self._bits_per_dim(logp, x).mean()}
        if self.exact_sm_batches < 0 or batch_idx < self.exact_sm_batches:
            subset = x[: self.exact_sm_samples]
            # The metric is the exact SM loss of the model as solved to tolerance: derivatives through a cold
            # unroll of the solver, not the phantom surrogate used in training (nor IFT, which cannot be
            # differentiated twice), so DEQ and explicit rows are comparable.
            with deq_backward(self.net, "unroll"):
                metrics["exact_sm"] = exact_score_matching(self.score, subset, create_graph=False).mean()
        return metrics

    def _bits_per_dim(self, logp: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # the data module knows its pre-processing (clamp or invertible squeeze); without one, assume the clamp
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if hasattr(datamodule, "bits_per_dim"):
            return datamodule.bits_per_dim(logp, x)
        return bits_per_dim(logp, inverse_logit(x))

    @torch.no_grad()
    def sample(self, n: int) -> torch.Tensor:
        """``n`` samples as images in [0, 1], shape ``[n, 1, 28, 28]`` for MNIST (``[n, dim]`` otherwise)."""
        x = inverse_logit(self.net.sample(n))
        side = int(round(self.net.dim**0.5))
        return x.view(n, 1, side, side) if side * side == self.net.dim else x
