"""NICE density estimation (MNIST) trained by maximum likelihood or any score-matching loss.

Data come in logit space (see :mod:`deqscore.data.transforms`); validation and test report the model's
log-likelihood in logit space (nats, as the reference code), its bits/dim of the 8-bit pixels (logit Jacobian
and dequantisation included; ``bits_per_dim`` with the invertible ``logit_squeeze`` pipeline,
``bits_per_dim_approx`` with the clamp pipelines, docs/method.md section 4.1) and the exact score-matching loss.

Config (the network's and the DEQ layer's options are those of :class:`deqscore.models.NICE` and
:class:`deqscore.deq.DEQ`)::

    model:
      class_path: deqscore.lightning.NICEModule
      init_args:
        net:
          class_path: deqscore.models.NICE
          init_args: {m_net: deq, deq: {class_path: deqscore.deq.DEQ, init_args: {solver: picard}}}
        loss: ssm            # or {class_path: deqscore.losses.SSM, init_args: {n_projections: 2}}
"""

from __future__ import annotations

from typing import Any, Literal

import pytorch_lightning as pl
import torch

from ..data.protocol import DensityData
from ..data.transforms import TRANSFORMS
from ..deq import deq_backward, require_backward
from ..errors import ConfigError
from ..losses import ScoreLoss, build_loss, exact_score_matching, loss_names, score_from_log_prob
from ..models import NICE, NICEObjective
from .base import ScoreModule

NICE_LOSSES = loss_names(ScoreLoss, NICEObjective)
NICELossName = Literal[NICE_LOSSES]  # type: ignore[valid-type]  # the registered names, checked when parsing


class NICEModule(ScoreModule):
    """LightningModule around :class:`deqscore.models.NICE`."""


    def __init__(
        self,
        net: NICE,  # the flow, with its m-net and DEQ options
        loss: NICELossName | ScoreLoss | NICEObjective = "ssm",  # a short name or a loss object
        exact_sm_batches: int = 1,  # val/test batches on which exact SM is computed (-1: all); D backward passes each
        exact_sm_samples: int | None = None,  # at most this many samples of such a batch (None: all)
    ):
        super().__init__()
        if exact_sm_samples is not None and exact_sm_samples < 1:
            raise ConfigError(f"exact_sm_samples must be >= 1 or null, got {exact_sm_samples}", key="exact_sm_samples")
        self.net = net
        self.loss = build_loss(loss, ScoreLoss, NICEObjective, key="loss")
        if getattr(self.loss, "explicit_only", False) and net.m_net_kind != "explicit":
            raise ConfigError(
                f"loss {self.loss.name!r} (approximate backprop) works only with net m_net='explicit', "
                f"got m_net={net.m_net_kind!r}"
            )
        # a score loss differentiates the flow's score (a derivative of log p), then the parameters; MLE: once
        order = self.loss.input_derivatives + 2 if isinstance(self.loss, ScoreLoss) else 1
        require_backward(self.net, order, user=f"the loss {self.loss!r}")
        self.exact_sm_batches, self.exact_sm_samples = exact_sm_batches, exact_sm_samples

    def check_run(self, trainer: pl.Trainer, datamodule: Any) -> None:
        # a density needs dequantised data (a point mass at k/255 has no density)
        if getattr(datamodule, "transform", None) == "pixels":
            accepted = ", ".join(repr(t) for t in TRANSFORMS if t != "pixels")
            raise ConfigError("data.init_args.transform: NICE models the density of dequantised images; 'pixels' is "
                              f"not accepted\n  accepted: {accepted}")

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """Model score ``grad_x log p(x)`` (x must require grad)."""
        return score_from_log_prob(self.net.log_prob)(x)

    def compute_loss(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.loss, ScoreLoss):
            return self.loss(self.score, x)
        return self.loss(self.net, x)

    def eval_metrics(self, x: torch.Tensor, stage: str, batch_idx: int) -> dict[str, torch.Tensor]:
        logp = self.net.log_prob(x).detach()
        metrics = {"log_likelihood": logp.mean()}
        datamodule = self.datamodule()
        if isinstance(datamodule, DensityData):  # the data module knows its pre-processing
            name = "bits_per_dim" if datamodule.bits_per_dim_exact else "bits_per_dim_approx"
            metrics[name] = datamodule.bits_per_dim(logp, x).mean()
        if self.exact_sm_batches < 0 or batch_idx < self.exact_sm_batches:
            subset = x[: self.exact_sm_samples]
            # The metric is the exact SM loss of the model as solved to tolerance: derivatives through a cold
            # unroll of the solver, not the phantom surrogate used in training (nor IFT, which cannot be
            # differentiated twice), so DEQ and explicit rows are comparable.
            with deq_backward(self.net, "unroll"):
                metrics["exact_sm"] = exact_score_matching(self.score, subset, create_graph=False).mean()
        return metrics

    @torch.no_grad()
    def sample(self, n: int) -> torch.Tensor:
        """``n`` samples ``[n, dim]`` in the model's (logit) space, by inverting the flow."""
        with self.sampling_mode():
            return self.net.sample(n)
