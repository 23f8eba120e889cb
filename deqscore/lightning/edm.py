"""EDM denoisers (Karras et al. 2022) with explicit or DEQ bodies: trained by EDM's denoising loss, sampled by its
deterministic Heun sampler (:mod:`deqscore.models.edm`, :class:`deqscore.sampling.heun.EDMHeun`).

Images come as ``pixels`` (``k / 255`` in ``[0, 1]``) and are mapped to ``[-1, 1]`` (``2x - 1``), where the noise
levels, ``sigma_data = 0.5`` and the sampler's ``sigma_max = 80`` are meant; samples are mapped back. Each
training sample draws ``ln sigma ~ N(p_mean, p_std^2)``; validation and test report the same loss with fixed
draws (the run's seeding), the held-out denoising loss.

The loss is first-order in the network's output, so a DEQ body may use ``backward: ift`` or ``implicit`` (both
exact) or ``phantom``. While sampling, each DEQ solve starts from the previous evaluation's fixed point (the next Heun
evaluation is at the same or a nearby noise level and input); ``sampling_cost`` (:class:`.base.ScoreModule`) counts
network evaluations per sample and solver iterations per evaluation, cold or warm.

Config::

    model:
      class_path: deqscore.lightning.edm.EDMModule
      init_args:
        net: {class_path: deqscore.models.edm.EDM, init_args: {channels: 1, ngf: 32, body: deq}}
        sampler: {class_path: deqscore.sampling.heun.EDMHeun, init_args: {num_steps: 18}}
"""

from __future__ import annotations

import torch

from ..data.protocol import ImageData
from ..errors import ConfigError
from ..models.edm import EDM, EDMLoss
from ..sampling.heun import EDMHeun
from ..sampling.langevin import seeded_generator
from .base import ScoreModule


class EDMModule(ScoreModule):
    """LightningModule around :class:`deqscore.models.edm.EDM`."""

    def __init__(
        self,
        net: EDM,  # the denoiser, with its body and DEQ options
        p_mean: float = -1.2,  # mean of ln sigma in training
        p_std: float = 1.2,  # standard deviation of ln sigma in training
        sampler: EDMHeun | None = None,  # Heun sampler options (None: EDMHeun's defaults, 18 steps)
    ):
        super().__init__()
        self.net = net
        self.loss = EDMLoss(net.sigma_data, p_mean, p_std)
        self.sampler = sampler or EDMHeun()

    def check_run(self, trainer, datamodule) -> None:  # noqa: ANN001 - the base's signature
        if isinstance(datamodule, ImageData) and datamodule.codec.transform != "pixels":
            raise ConfigError(f"data transform {datamodule.codec.transform!r}: the EDM family takes images as "
                              "pixels in [0, 1] (set data.init_args.transform: pixels)")

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.check_image_shape("EDM")

    def compute_loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss(self.net, 2 * x - 1)

    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator | None = None, warm: bool = True) -> torch.Tensor:
        """``n`` samples ``[n, dim]`` in ``[0, 1]`` by the Heun sampler, the network in eval mode and (``warm``)
        each DEQ solve started from the previous evaluation's fixed point; ``x_0`` comes from ``generator``
        (default: seeded from torch's RNG, so ``torch.manual_seed`` fixes the samples)."""
        device = next(self.net.parameters()).device
        generator = generator or seeded_generator(device)
        with self.sampling_mode(warm):
            y = self.sampler(self.net, (n, self.net.dim), generator, device=device)
        return ((y + 1) / 2).clamp(0, 1)
