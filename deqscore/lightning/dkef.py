"""Deep kernel exponential families (DKEF) on UCI data, with explicit or DEQ feature networks (docs/method.md 4.2).

Training is two-stage (Wenliang et al. 2019): each step solves the kernel coefficients alpha in closed form on one
half of the batch (differentiably) and evaluates the score-matching loss on the other half, both with the DEQ's
configured backward. At the start of every validation the stored alpha is solved afresh on ``alpha_points`` random
training points, and validation scores the model with it.

Derivative modes: every reported figure (validation and test loss, exact SM, log-likelihood, Fisher divergence), the
stored alpha they use and the closing stage take the derivatives of the converged model (``unroll``, a no-op for
explicit feature nets), so alpha minimises exactly the loss that is reported; only training's own alpha and loss use
the configured backward (``phantom`` by default).
The closing stage after fit (:meth:`DKEFModule.closing_stage`, run by the base's ``ClosingStage`` callback on the
best checkpoint's weights) solves alpha on the whole training set and fine-tunes ``log_lambda`` alone on validation
batches; the result is saved as ``checkpoints/final.ckpt``.

Samples (:meth:`DKEFModule.sample`, ``sample.py``) are drawn by Langevin dynamics on the model's density
(``sampler``: Metropolis-adjusted by default, so the chain's stationary law is the model's own), in the whitened
space, and written in the data's units through the whitening the checkpoint keeps.

Validation and test log the loss, the exact score-matching loss (``exact_sm``) and the log-likelihood, with log Z
estimated by importance sampling (``log_z``, ``log_z_stderr``, ``log_z_ess``; ``log_z_proposal``: ``mixture``,
the default, half the broad Gaussian ``N(0, 4 I)`` and half Gaussians at the whitened training points, or
``gaussian``, the broad Gaussian alone, which a trained model's mass is rarely drawn from: on RedWine it gives 5-18
effective draws of 5,000 where the mixture gives hundreds); on the synthetic ``highdim`` data also the Fisher
divergence to the true N(0, I) and the true log-likelihood of the same points.

Config::

    model:
      class_path: deqscore.lightning.DKEFModule
      init_args:
        net: {class_path: deqscore.models.DKEF, init_args: {feature_net: deq}}   # dim comes from the data
        loss: ssm_vr
    data: {class_path: deqscore.data.UCIDataModule, init_args: {dataset: redwine}}
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from jsonargparse import lazy_instance

from ..deq import deq_backward
from ..errors import ConfigError, check_count, check_real
from ..losses import DSM, SSM, SSMVR, ExactSM, ScoreLoss, build_loss, exact_score_matching
from ..models import DKEF
from ..models.dkef import effective_sample_size
from ..sampling.langevin import Langevin, plain_copy, seeded_generator
from .base import ScoreModule

DKEF_LOSSES = ("exact", "ssm", "ssm_vr", "dsm")
LOG_Z_PROPOSALS = ("gaussian", "mixture")
FINAL_STAGE_SEED = 0  # random draws of the final alpha system (projections or noise)


#: the sampler of a config that names none (printed with its options by --print_config)
DEFAULT_SAMPLER = lazy_instance(Langevin)
ALPHA_CHUNK = 256  # rows per chunk of a graph-free alpha system


def alpha_objective(loss: ScoreLoss) -> dict[str, Any]:
    """The closed-form alpha system that matches ``loss`` (docs/method.md 3.7)."""
    if isinstance(loss, SSMVR):  # before SSM: a subclass
        return {"objective": "sliced_vr", "projection": loss.projection}
    if isinstance(loss, SSM):
        return {"objective": "sliced", "projection": loss.projection}
    if isinstance(loss, ExactSM):
        return {"objective": "exact"}
    if isinstance(loss, DSM):
        return {"objective": "dsm", "sigma": loss.sigma, "dsm_weighting": loss.weighting}
    raise ConfigError(f"loss: DKEF has a closed-form alpha for {', '.join(DKEF_LOSSES)}, not {loss!r}", key="loss")


class DKEFModule(ScoreModule):
    """LightningModule around :class:`deqscore.models.DKEF`."""


    def __init__(
        self,
        net: DKEF,  # the kernel model, with its feature network and DEQ options
        loss: Literal["exact", "ssm", "ssm_vr", "dsm"] | ScoreLoss = "ssm_vr",  # also fixes the alpha system
        alpha_points: int = 1000,  # training points the stored alpha is solved on at each validation
        log_z_samples: int = 250_000,  # importance samples of log Z at each validation
        final_log_z_samples: int = 1_000_000,  # ... at test time
        log_z_chunk: int = 10_000,  # samples per chunk (memory: chunk x centres; mixture: also x training points)
        final_lambda_steps: int = 1000,  # Adam steps on log_lambda alone at the end of fit (0: none)
        final_lambda_lr: float = 1e-3,  # their learning rate
        exact_sm_batches: int = -1,  # val/test batches on which exact SM is computed (-1: all)
        log_z_proposal: Literal["gaussian", "mixture"] = "mixture",  # importance proposal of log Z (see below)
        sampler: Langevin = DEFAULT_SAMPLER,  # the Langevin chain of sample() on the model's density
    ):
        sampler = plain_copy(sampler)  # before the hyper-parameters copy it: the default is one shared object
        super().__init__()
        self.net = net
        self.loss = build_loss(loss, ScoreLoss, key="loss")
        # the alpha system of the loss, graph-free systems accumulated over chunks of ALPHA_CHUNK rows
        self.alpha_kwargs = {**alpha_objective(self.loss), "chunk": ALPHA_CHUNK}
        for key, value in (("alpha_points", alpha_points), ("log_z_samples", log_z_samples),
                           ("final_log_z_samples", final_log_z_samples), ("log_z_chunk", log_z_chunk)):
            check_count(key, value)
        check_count("final_lambda_steps", final_lambda_steps, low=0)
        check_real("final_lambda_lr", final_lambda_lr)
        self.alpha_points, self.log_z_chunk = alpha_points, log_z_chunk
        self.log_z_samples, self.final_log_z_samples = log_z_samples, final_log_z_samples
        self.final_lambda_steps, self.final_lambda_lr = final_lambda_steps, final_lambda_lr
        self.exact_sm_batches = exact_sm_batches
        if log_z_proposal not in LOG_Z_PROPOSALS:
            raise ConfigError(f"log_z_proposal: expected one of {', '.join(LOG_Z_PROPOSALS)}, got {log_z_proposal!r}",
                              key="log_z_proposal")
        self.log_z_proposal = log_z_proposal
        self.sampler = sampler
        self._log_z: tuple[float, float, int] | None = None  # log Z, its standard error, the draws

    # ----- data -----------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = self.datamodule()
        if stage == "fit" and datamodule is not None:  # a resumed run then restores its trained centres
            self.net.init_centres(datamodule.train_data, torch.Generator().manual_seed(0))

    def _refresh_alpha(self, seed: int) -> None:
        """Solve alpha on ``alpha_points`` random training points (seeded by the step: exact resume), with the
        derivatives of the converged model (unroll), as every reported metric that uses it."""
        datamodule = self.datamodule()
        if datamodule is None:
            return
        points = datamodule.train_subset(self.alpha_points, torch.Generator().manual_seed(seed)).to(self.device)
        with torch.enable_grad(), deq_backward(self.net, "unroll"):
            alpha = self.net.solve_alpha(points, create_graph=False, **self.alpha_kwargs)
        self.net.set_alpha(alpha.detach())

    # ----- training -------------------------------------------------------------------------------------------
    def score_with(self, alpha: torch.Tensor | None):
        return lambda x: self.net.score(x, alpha)

    def compute_loss(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:  # evaluation: the stored alpha, refreshed from training points; the converged model
            with deq_backward(self.net, "unroll"):
                return self.loss(self.score_with(None), x)
        if len(x) < 2:
            raise ConfigError("DKEF training needs batches of at least 2 points (alpha on one half, loss on the other)")
        half = len(x) // 2
        alpha = self.net.solve_alpha(x[:half], create_graph=True, **self.alpha_kwargs)
        return self.loss(self.score_with(alpha), x[half:])

    # ----- evaluation -----------------------------------------------------------------------------------------
    def _estimate_log_z(self, n_samples: int) -> None:
        generator = torch.Generator(device=self.device).manual_seed(12345)
        points = None
        if self.log_z_proposal == "mixture":
            datamodule = self.datamodule()
            if datamodule is None:
                raise ConfigError("log_z_proposal 'mixture': its points are the training data; run with a data module",
                                  key="log_z_proposal")
            points = datamodule.train_data.to(self.device)
        log_z, stderr = self.net.log_partition(n_samples=n_samples, chunk=self.log_z_chunk, generator=generator,
                                               proposal_points=points)
        self._log_z = (float(log_z), float(stderr), n_samples)

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self._refresh_alpha(seed=self.global_step)  # the alpha that validation and the checkpoint use
        self._estimate_log_z(self.log_z_samples)

    def on_test_epoch_start(self) -> None:
        super().on_test_epoch_start()
        self._estimate_log_z(self.final_log_z_samples)

    def eval_metrics(self, x: torch.Tensor, stage: str, batch_idx: int) -> dict[str, torch.Tensor]:
        metrics: dict[str, Any] = {}
        if self._log_z is not None:
            log_z, stderr, n_draws = self._log_z
            whitened = (self.net.log_density(x).detach() - log_z).mean()
            # in the data's own units (the whitening's Jacobian added), and in the whitened space the model sees
            jacobian = getattr(self.datamodule(), "log_det_whitening", 0.0)
            metrics |= {"log_likelihood": whitened + jacobian, "log_likelihood_whitened": whitened, "log_z": log_z,
                        "log_z_stderr": stderr, "log_z_ess": effective_sample_size(stderr, n_draws)}
        if self.exact_sm_batches < 0 or batch_idx < self.exact_sm_batches:
            with deq_backward(self.net, "unroll"):  # the model as solved to tolerance (see NICEModule)
                metrics["exact_sm"] = exact_score_matching(self.score_with(None), x, create_graph=False).mean()
        datamodule = self.datamodule()
        true_score = getattr(datamodule, "true_score", None)
        if true_score is not None and true_score(x) is not None:
            xg = x.detach().requires_grad_(True)
            with deq_backward(self.net, "unroll"):
                model_score = self.net.score(xg).detach()
            metrics["fisher_divergence"] = 0.5 * (model_score - true_score(x)).pow(2).sum(1).mean()
            metrics["true_log_likelihood"] = datamodule.true_log_prob(x).mean()
        return metrics

    # ----- samples ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` samples ``[n, dim]`` of the model's density with its stored alpha, in the whitened space it was
        trained in (``sample_points`` maps them to the data's units), by the configured Langevin chain with the
        derivatives of the converged model (as every reported figure); the noise comes from ``generator``
        (default: seeded from torch's RNG, so ``torch.manual_seed`` fixes the samples)."""
        device, dtype = self.net.centres.device, self.net.centres.dtype
        with self.sampling_mode(), deq_backward(self.net, "unroll"):
            return self.sampler(self.net.log_density, (n, self.net.dim), generator or seeded_generator(device),
                                device=device, dtype=dtype)

    # ----- the final stage ------------------------------------------------------------------------------------
    def closing_stage(self, datamodule: Any) -> None:
        """Solve alpha on the whole training set and fine-tune ``log_lambda`` alone on validation batches, with
        every random draw (projections, noise) seeded: the same best weights give the same final model, whether
        the stage runs at the end of training or in a resumed run."""
        with torch.random.fork_rng(), deq_backward(self.net, "unroll"):  # the converged model, as the metrics
            torch.manual_seed(FINAL_STAGE_SEED)
            self._closing_stage(datamodule)

    def _closing_stage(self, datamodule: Any) -> None:
        train = datamodule.train_data.to(self.device)
        with torch.enable_grad():
            g, b = self.net.alpha_system(train, create_graph=False, **self.alpha_kwargs)
        optimizer = torch.optim.Adam([self.net.log_lambda], lr=self.final_lambda_lr)
        val = datamodule.val_data.to(self.device)
        generator = torch.Generator().manual_seed(0)
        batch = min(len(val), datamodule.eval_batch_size)
        for _ in range(self.final_lambda_steps):
            x = val[torch.randperm(len(val), generator=generator)[:batch].to(self.device)]
            with torch.enable_grad():
                alpha = self.net.alpha_from_system(g, b)
                loss = self.loss(self.score_with(alpha), x).mean()
                optimizer.zero_grad()
                loss.backward()
            optimizer.step()
        with torch.no_grad():
            self.net.set_alpha(self.net.alpha_from_system(g, b))
        if not math.isfinite(float(self.net.log_lambda.detach())):
            raise ConfigError("log_lambda became non-finite while fine-tuned: lower final_lambda_lr",
                              key="final_lambda_lr")


__all__ = ["DKEF_LOSSES", "DKEFModule", "alpha_objective"]
