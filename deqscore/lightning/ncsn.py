"""Noise-conditional score networks (NCSN) trained by annealed score matching, sampled by annealed Langevin
dynamics (docs/method.md 4.4).

Each training sample draws a noise level from the schedule (``schedule``, ``sigma_max``, ``sigma_min``,
``n_levels``) and the annealed loss (``annealed_dsm``, ``annealed_ssm_vr``, ``annealed_fd_ssm``) is taken on the
perturbed image; validation reports the same loss with fixed draws. :meth:`NCSNModule.sample` runs the
configured :class:`deqscore.sampling.AnnealedLangevin` with the network in eval mode.

Weights averaging (EMA, decay 0.999 in NCSNv2) is Lightning's callback as
:class:`deqscore.lightning.EMAWeightAveraging` (the NCSN configs list it): validation,
the FID callback and checkpoints' ``state_dict`` use the averaged weights (the raw ones are kept beside them, so
training resumes exactly), and ``sample.py`` samples from them unless told ``--raw-weights``.

Config::

    model:
      class_path: deqscore.lightning.NCSNModule
      init_args:
        net: {class_path: deqscore.models.NCSN, init_args: {channels: 3, ngf: 128, body: deq}}
        loss: annealed_dsm
        sigma_max: 50.0
        sigma_min: 0.01
        n_levels: 232
        sampler: {class_path: deqscore.sampling.AnnealedLangevin, init_args: {n_steps_each: 5, step_lr: 6.2e-6}}
"""

from __future__ import annotations

from typing import Literal

import torch
from jsonargparse import lazy_instance
from pytorch_lightning.utilities import rank_zero_info

from ..deq import require_backward
from ..losses import SCHEDULES, AnnealedLoss, build_loss, dsm_every_level, loss_names, noise_schedule
from ..losses.annealed import schedule_from_data
from ..models import NCSN
from ..sampling.langevin import AnnealedLangevin, plain_copy, seeded_generator
from .base import ScoreModule

#: the sampler of a config that names none (printed with its options by --print_config)
DEFAULT_SAMPLER = lazy_instance(AnnealedLangevin)
NCSN_LOSSES = loss_names(AnnealedLoss)
NCSNLossName = Literal[NCSN_LOSSES]  # type: ignore[valid-type]  # the registered names, checked when parsing
ScheduleName = Literal[tuple(SCHEDULES)]  # type: ignore[valid-type]


class NCSNModule(ScoreModule):
    """LightningModule around :class:`deqscore.models.NCSN`."""


    def __init__(
        self,
        net: NCSN,  # the score network, with its body and DEQ options
        loss: NCSNLossName | AnnealedLoss = "annealed_dsm",  # a short name or a loss object
        schedule: ScheduleName = "geometric",  # spacing of the noise levels
        sigma_max: float = 50.0,  # sigma_1, the largest noise level (CIFAR-10: 50)
        sigma_min: float = 0.01,  # sigma_L, the smallest
        n_levels: int = 232,  # L (CIFAR-10: 232)
        sampler: AnnealedLangevin | None = DEFAULT_SAMPLER,  # annealed Langevin options (None: the defaults)
        schedule_from_data: bool = False,  # sigma_max, n_levels and the sampler's step_lr from the training data
        schedule_data_subset: int = 10_000,  # training images whose largest pairwise distance gives sigma_max
        test_every_level: bool = False,  # test/dsm_every_level: the denoising loss at every level, fixed noise
    ):
        sampler = plain_copy(sampler)  # before the hyper-parameters copy it: the default is one shared object
        super().__init__()
        self.net = net
        self.loss = build_loss(loss, AnnealedLoss, key="loss")
        # SSM-VR differentiates the network's output w.r.t. x, then the parameters: twice through a DEQ
        require_backward(self.net, self.loss.input_derivatives + 1, user=f"the loss {self.loss!r}")
        self.schedule, self.sigma_min = schedule, sigma_min
        # Not a buffer (it follows the module's device and dtype through _apply): weight averaging copies the
        # buffers at setup, and a schedule from the data changes the number of levels after that copy.
        self.sigmas = noise_schedule(schedule, sigma_max, sigma_min, n_levels).float()
        self.sampler = sampler or AnnealedLangevin()  # None: a checkpoint saved before the default was shown
        self.schedule_from_data, self.schedule_data_subset = schedule_from_data, schedule_data_subset
        self.test_every_level = test_every_level

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and self.schedule_from_data:
            self._schedule_from(self.datamodule())
        self.check_image_shape("NCSN")

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - torch's signature
        self.sigmas = fn(self.sigmas)
        return super()._apply(fn, recurse)

    def _schedule_from(self, datamodule) -> None:
        """NCSNv2's schedule from the training data (:func:`deqscore.losses.annealed.schedule_from_data`), stored in
        the hyper-parameters so that a checkpoint, a resume and ``sample.py`` use the same values."""
        datamodule.setup("fit")
        train = datamodule.train_dataset
        n = min(len(train), self.schedule_data_subset)
        x = torch.stack([train[i][0] for i in range(n)])  # the first n training items, in model space
        derived = schedule_from_data(x, self.sigma_min, self.sampler.n_steps_each)
        self.sigmas = noise_schedule(self.schedule, derived["sigma_max"], self.sigma_min, derived["n_levels"]).to(
            self.sigmas)
        self.sampler.step_lr = derived["step_lr"]
        self.hparams.update(sigma_max=derived["sigma_max"], n_levels=derived["n_levels"], schedule_from_data=False)
        sampler = self.hparams.get("sampler") or {"class_path": f"{AnnealedLangevin.__module__}.AnnealedLangevin"}
        if isinstance(sampler, dict):  # a config (built from one), so that load_module rebuilds this sampler
            sampler.setdefault("init_args", {})["step_lr"] = derived["step_lr"]
            self.hparams["sampler"] = sampler
        rank_zero_info(f"noise schedule from {n} training items: sigma_max {derived['sigma_max']:.4g} (largest "
                       f"pairwise distance), ratio {derived['gamma']:.5f}, n_levels {derived['n_levels']}, Langevin "
                       f"step_lr {derived['step_lr']:.3g} for {self.sampler.n_steps_each} steps per level")

    def compute_loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss(self.net, x, self.sigmas)

    def eval_metrics(self, x: torch.Tensor, stage: str, batch_idx: int) -> dict[str, torch.Tensor]:
        """With ``test_every_level``, in test: the denoising loss at every noise level (``dsm_level_<i>``, largest
        sigma first), their mean (``dsm_every_level``) and its square's mean (``dsm_every_level_sq``, for a standard
        error over images), the noise of batch ``i`` drawn from seed ``i``: a held-out figure free of the training
        loss's random levels, the same noise for every network tested on the same batches."""
        if stage != "test" or not self.test_every_level:
            return {}
        with torch.no_grad():
            losses = dsm_every_level(self.net, x, self.sigmas, torch.Generator().manual_seed(batch_idx))
        per_image = losses.mean(dim=1)
        return {"dsm_every_level": per_image.mean(), "dsm_every_level_sq": per_image.pow(2).mean(),
                **{f"dsm_level_{i}": level for i, level in enumerate(losses.mean(dim=0))}}

    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator | None = None, warm: bool = True) -> torch.Tensor:
        """``n`` samples ``[n, dim]`` (images in [0, 1] for the ``pixels`` transform) by annealed Langevin dynamics
        with the network in eval mode and (``warm``) each DEQ solve started from the previous evaluation's fixed
        point (each still solved to its tolerance); the noise comes from ``generator`` (default: seeded from torch's
        RNG, so ``torch.manual_seed`` fixes the samples)."""
        device = self.sigmas.device
        generator = generator or seeded_generator(device)
        with self.sampling_mode(warm):
            return self.sampler(self.net, (n, self.net.dim), self.sigmas, generator, device=device)
