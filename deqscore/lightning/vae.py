"""VAEs with an implicit encoder (entropy gradient from a score network trained by SSM-VR) and the Gaussian-encoder
baseline, on binarised MNIST (MLP) and 32x32 / 64x64 RGB images (conv) (docs/method.md sections 3.8, 4.3).

Each training step (two optimisers, stepped by the base in :meth:`VAEModule.optimizer_steps` order):

1. ``score_updates`` (default 2) steps of the score network's optimiser on its SSM-VR loss, on encoder samples with
   x and z detached: nothing reaches the encoder, the decoder or their optimiser;
2. one step of the encoder/decoder optimiser on the surrogate (the score enters detached: nothing reaches the score
   network or its optimiser).

Lightning counts every optimiser step in ``global_step`` (``score_updates + 1`` per batch). MNIST pixels are
binarised afresh every step (``x = 1[U <= p]``, seeded by the step, so a resume repeats it); RGB images get the
dequantisation noise ``U(-1/2, 1/2)/256``. Validation and test log the surrogate (``loss``; the negative ELBO for the
Gaussian baseline), the score network's SSM-VR loss (``score_ssm``) and, for MNIST decoders on the first
``ais_batches`` test batches, the AIS estimate of ``log p(x)`` (``ais_log_likelihood``, nats; a stochastic lower
bound); with ``val_ais_batches``, a smaller AIS estimate (``val_ais_steps`` distributions) on the first validation
batches, the figure by which the MLP configs keep their best checkpoint: the surrogate ``val/loss`` is no likelihood
(the implicit encoder has no ELBO) and rewards low-entropy encoders, so it cannot choose one. The conv configs (no
AIS: Gaussian decoder) keep only ``last.ckpt``. Samples are decoder means of ``z ~ N(0, I)``, so ``sample.py`` and
the FID callback work unchanged.

Config::

    model:
      class_path: deqscore.lightning.VAEModule
      init_args:
        net: {class_path: deqscore.models.ImplicitVAE, init_args: {arch: mlp, z_dim: 8, score: deq}}
        ae_optimizer: {class_path: torch.optim.RMSprop, init_args: {lr: 1.0e-3}}
        score_optimizer: {class_path: torch.optim.RMSprop, init_args: {lr: 1.0e-3}}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import OptimizerCallable
from pytorch_lightning.strategies import DDPStrategy

from ..errors import ConfigError, check_count, check_real
from ..metrics.ais import ais_log_likelihood
from ..models import GaussianVAE, ImplicitVAE
from ..privates import attached_trainer, finds_unused_parameters
from .base import ScoreModule


class VAEModule(ScoreModule):
    """LightningModule around :class:`deqscore.models.ImplicitVAE` or :class:`deqscore.models.GaussianVAE`."""

    deq_objective = "score_ssm"  # the DEQ is in the score network, trained by its own SSM-VR term

    def __init__(
        self,
        net: ImplicitVAE | GaussianVAE,  # the VAE (encoder, decoder and, if implicit, score network)
        ae_optimizer: OptimizerCallable = torch.optim.RMSprop,  # encoder/decoder optimiser (configs set lr)
        score_optimizer: OptimizerCallable = torch.optim.RMSprop,  # score-network optimiser
        score_updates: int = 2,  # score-network steps per encoder/decoder step
        binarize: bool | None = None,  # dynamic binarisation (None: for the MLP / Bernoulli decoder)
        ais_batches: int = 0,  # test batches scored by AIS (MNIST decoders); 0: none
        ais_steps: int = 1000,  # AIS intermediate distributions
        ais_chains: int = 16,  # AIS chains per image
        ais_leapfrog: int = 10,  # leapfrog steps per HMC move
        ais_step_size: float = 0.01,  # initial HMC step size (adapted per chain)
        val_ais_batches: int = 0,  # validation batches scored by a small AIS (best-checkpoint figure); 0: none
        val_ais_steps: int = 100,  # its intermediate distributions
    ):
        super().__init__()
        check_count("VAEModule score_updates", score_updates, low=0)
        check_count("VAEModule ais_batches", ais_batches, low=0)
        check_count("VAEModule val_ais_batches", val_ais_batches, low=0)
        check_count("VAEModule val_ais_steps", val_ais_steps)
        check_count("VAEModule ais_steps", ais_steps)
        check_count("VAEModule ais_chains", ais_chains)
        check_count("VAEModule ais_leapfrog", ais_leapfrog)
        check_real("VAEModule ais_step_size", ais_step_size)
        self.net = net
        self.implicit = isinstance(net, ImplicitVAE)
        for key, value in (("ais_batches", ais_batches), ("val_ais_batches", val_ais_batches)):
            if value and net.arch != "mlp":
                raise ConfigError(f"VAEModule {key}: AIS is for the Bernoulli (MLP) decoder of binarised MNIST",
                                  key=key)
        self.ae_optimizer, self.score_optimizer = ae_optimizer, score_optimizer
        self.score_updates = score_updates if self.implicit else 0
        self.binarize = net.arch == "mlp" if binarize is None else binarize
        self.ais = {"n_steps": ais_steps, "n_chains": ais_chains, "leapfrog": ais_leapfrog, "step_size": ais_step_size}
        self.ais_batches = {"val": val_ais_batches, "test": ais_batches}
        self.val_ais_steps = val_ais_steps
        self.automatic_optimization = False

    def check_run(self, trainer: pl.Trainer, datamodule: Any) -> None:
        strategy = trainer.strategy
        # Each optimiser's loss leaves the other network out of its graph: DDP must be told to expect that (with it,
        # every manual backward re-arms the gradient averaging for the parameters it reaches).
        if isinstance(strategy, DDPStrategy) and not finds_unused_parameters(strategy):
            raise ConfigError("trainer.strategy: the VAE under DDP needs 'ddp_find_unused_parameters_true' (each of "
                              "its two losses uses only its own network)")

    # ----- data ---------------------------------------------------------------------------------------------
    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Binarised (MNIST) or dequantised (RGB) pixels, from the global RNG (seeded per step by the base)."""
        if self.binarize:
            return torch.bernoulli(x.clamp(0, 1))
        return (x + (torch.rand_like(x) - 0.5) / 256).clamp(0, 1)

    # ----- losses -------------------------------------------------------------------------------------------
    def compute_loss(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        terms = {"loss": self.net.surrogate(x)}
        if self.implicit:
            terms["score_ssm"] = self.net.score_loss(x)
        return terms

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        optimizers = [self.ae_optimizer(self.net.ae_parameters())]
        if self.implicit:
            optimizers.append(self.score_optimizer(self.net.score.parameters()))
        return optimizers

    def optimizer_steps(self, x: torch.Tensor) -> Iterator[tuple[int, str, Callable[[], torch.Tensor]]]:
        for _ in range(self.score_updates):  # the score network first, on the current encoder
            yield 1, "score_ssm", lambda: self.net.score_loss(x)
        yield 0, "loss", lambda: self.net.surrogate(x)

    def eval_metrics(self, x: torch.Tensor, stage: str, batch_idx: int) -> dict[str, torch.Tensor]:
        if batch_idx >= self.ais_batches.get(stage, 0) or (stage == "val" and self._smoke_validation()):
            return {}
        options = self.ais | ({"n_steps": self.val_ais_steps} if stage == "val" else {})
        gen = torch.Generator(device=x.device).manual_seed(batch_idx)
        estimate = ais_log_likelihood(self.net.log_likelihood, x, self.net.z_dim, generator=gen, **options)
        return {"ais_log_likelihood": estimate.mean()}

    def _smoke_validation(self) -> bool:
        """Whether this validation only checks that the loop runs (Lightning's sanity check before training, or a
        ``fast_dev_run``): nothing it logs is kept or monitored, so its AIS (minutes on a CPU) is skipped."""
        trainer = attached_trainer(self)
        return trainer is not None and (trainer.sanity_checking or bool(trainer.fast_dev_run))

    # ----- samples ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, n: int) -> torch.Tensor:
        """Decoder means of ``n`` prior draws, ``[n, dim]`` in [0, 1]."""
        device = next(self.net.parameters()).device
        with self.sampling_mode():
            return self.net.decode_mean(torch.randn(n, self.net.z_dim, device=device))
