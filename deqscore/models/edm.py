"""EDM denoisers (Karras et al. 2022): a preconditioned network ``D(x; sigma)``, its loss, and a small U-Net with
an explicit or a DEQ middle (the family's module is :mod:`deqscore.lightning.edm`).

**Preconditioning** (:func:`edm_coefficients`): for data of standard deviation ``sigma_data``,
``D(x; sigma) = c_skip x + c_out F(c_in x, c_noise)`` with ``c_skip = sd^2 / (sigma^2 + sd^2)``,
``c_out = sigma sd / sqrt(sigma^2 + sd^2)``, ``c_in = 1 / sqrt(sigma^2 + sd^2)``, ``c_noise = ln(sigma) / 4``: the
raw network ``F`` sees unit-variance inputs and has a unit-variance target at every noise level.

**Loss** (:class:`EDMLoss`): ``ln sigma ~ N(P_mean, P_std^2)``, ``lambda(sigma) ||D(x + sigma n; sigma) - x||^2``
(mean over the values) with ``lambda = (sigma^2 + sd^2) / (sigma sd)^2 = 1 / c_out^2``, which makes the raw
network's regression target of unit variance. Its minimiser is the posterior mean ``E[x | x + sigma n]``.

**Networks** (:class:`EDM`, images ``[B, C*H*W]`` in ``[-1, 1]``, ``sigma_data = 0.5`` there): a U-Net of
residual blocks conditioned on ``c_noise`` (sinusoidal features, an MLP, a bias per block): full resolution
(``ngf``), half (``2 ngf``), a middle at half resolution, and a decoder with skip connections. The middle is

* ``body="unet"``: ``mid_blocks`` explicit residual blocks;
* ``body="deq"``: one weight-tied block as a fixed point ``z* = GN(u + conv(SiLU(GN(conv(z*)))))`` with ``u`` the
  encoder's half-resolution features plus the noise embedding, inside :class:`deqscore.deq.DEQ`.

The denoising loss differentiates the output only with respect to the parameters (first order), so the DEQ's
``backward="ift"`` gives the exact gradient of the converged layer (as does ``"implicit"``, which is not needed
here: it serves losses of higher order); ``"phantom"`` is its K-step truncation.

>>> import torch
>>> net = EDM(dim=64, channels=1, ngf=4, body="unet")
>>> net(torch.randn(2, 64), torch.tensor([0.5, 10.0])).shape
torch.Size([2, 64])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..deq import DEQ, DEQFactory
from ..errors import ConfigError, check_count, check_real, choice_error
from .common import as_images, image_side

EDM_BODIES = ("unet", "deq")
RawNet = Callable[[Tensor, Tensor], Tensor]  # (c_in x, c_noise [B]) -> F


def edm_coefficients(sigma: Tensor, sigma_data: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(c_skip, c_out, c_in, c_noise)`` of EDM's preconditioning at ``sigma`` (any shape).

    >>> c_skip, c_out, c_in, c_noise = edm_coefficients(torch.tensor([0.5]), 0.5)
    >>> [round(float(c), 4) for c in (c_skip, c_out, c_in, c_noise)]
    [0.5, 0.3536, 1.4142, -0.1733]
    """
    total = sigma**2 + sigma_data**2
    return sigma_data**2 / total, sigma * sigma_data / total.sqrt(), 1 / total.sqrt(), sigma.log() / 4


def edm_loss_weight(sigma: Tensor, sigma_data: float) -> Tensor:
    """``lambda(sigma) = (sigma^2 + sd^2) / (sigma sd)^2``, EDM's loss weighting (``1 / c_out^2``)."""
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


def _per_sample(t: Tensor, like: Tensor) -> Tensor:
    """``t`` ``[B]`` shaped to broadcast over the non-batch dimensions of ``like``."""
    return t.reshape(-1, *([1] * (like.dim() - 1)))


class Preconditioned(nn.Module):
    """``D(x; sigma) = c_skip x + c_out F(c_in x, c_noise)`` around a raw network ``F`` (see the module docstring);
    ``x`` is ``[B, ...]``, ``sigma`` a number or ``[B]``."""

    def __init__(self, raw: nn.Module, sigma_data: float = 0.5):
        super().__init__()
        check_real("EDM sigma_data", sigma_data)
        self.raw, self.sigma_data = raw, sigma_data

    def forward(self, x: Tensor, sigma: Tensor) -> Tensor:
        sigma = torch.as_tensor(sigma, dtype=x.dtype, device=x.device).expand(x.shape[0])
        c_skip, c_out, c_in, c_noise = (_per_sample(c, x) for c in edm_coefficients(sigma, self.sigma_data))
        return c_skip * x + c_out * self.raw(c_in * x, c_noise.flatten())


class EDMLoss:
    """EDM's denoising loss (see the module docstring): per sample ``[B]``, the noise from torch's global RNG or
    ``generator``. ``denoiser(x, sigma [B])`` is a :class:`Preconditioned` network (or any denoiser)."""

    def __init__(self, sigma_data: float = 0.5, p_mean: float = -1.2, p_std: float = 1.2):
        check_real("EDM sigma_data", sigma_data)
        check_real("EDM p_std", p_std)
        self.sigma_data, self.p_mean, self.p_std = sigma_data, p_mean, p_std

    def draw_sigma(self, n: int, like: Tensor, generator: torch.Generator | None = None) -> Tensor:
        z = torch.randn(n, generator=generator, device=like.device, dtype=like.dtype)
        return (self.p_mean + self.p_std * z).exp()

    def __call__(self, denoiser: RawNet, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        sigma = self.draw_sigma(x.shape[0], x, generator)
        noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        return self.at(denoiser, x, sigma, noise)

    def at(self, denoiser: RawNet, x: Tensor, sigma: Tensor, noise: Tensor) -> Tensor:
        """The loss with given levels ``[B]`` and noise (fixed draws, for held-out evaluation)."""
        err = denoiser(x + _per_sample(sigma, x) * noise, sigma) - x
        return edm_loss_weight(sigma, self.sigma_data) * err.reshape(x.shape[0], -1).pow(2).mean(1)


# ---------------------------------------------------------------- the U-Net


def _groups(channels: int) -> int:
    return math.gcd(channels, 8)


class NoiseEmbedding(nn.Module):
    """``c_noise`` -> sinusoidal features (frequencies 1 to 1,000, EDM's positional embedding) -> 2-layer MLP."""

    def __init__(self, features: int, out: int):
        super().__init__()
        half = features // 2
        self.register_buffer("freqs", torch.exp(-math.log(1000.0) * torch.arange(half) / max(half - 1, 1)) * 1000,
                             persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2 * half, out), nn.SiLU(), nn.Linear(out, out))

    def forward(self, c_noise: Tensor) -> Tensor:
        angles = c_noise[:, None] * self.freqs.to(c_noise.dtype)
        return self.mlp(torch.cat([angles.cos(), angles.sin()], dim=1))


class ResBlock(nn.Module):
    """GroupNorm, SiLU, conv, plus the embedding's per-channel bias, GroupNorm, SiLU, conv; a 1x1 shortcut when
    the width changes."""

    def __init__(self, c_in: int, c_out: int, emb: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(_groups(c_in), c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.emb = nn.Linear(emb, c_out)
        self.norm2, self.conv2 = nn.GroupNorm(_groups(c_out), c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.emb(emb)[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class EDMDEQMap(nn.Module):
    """``f(z, u) = GN(u + conv2(SiLU(GN(conv1(z)))))``: the weight-tied middle block (MDEQ's residual form). The
    outer GroupNorm bounds the iterates; ``conv2`` starts at a tenth of its default scale so that ``f`` starts
    well inside contraction (the solver's convergence is logged, not guaranteed)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.conv2 = (nn.Conv2d(channels, channels, 3, padding=1) for _ in range(2))
        self.norm1, self.norm_out = nn.GroupNorm(_groups(channels), channels), nn.GroupNorm(_groups(channels), channels)
        with torch.no_grad():
            self.conv2.weight.mul_(0.1)

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return self.norm_out(u + self.conv2(F.silu(self.norm1(self.conv1(z)))))


class UNet(nn.Module):
    """The raw network ``F(x_in, c_noise)`` on ``[B, C, H, W]`` (H, W even); see the module docstring."""

    def __init__(self, channels: int, ngf: int, body: str, mid_blocks: int, deq: DEQFactory | None):
        super().__init__()
        emb, n2 = 4 * ngf, 2 * ngf
        self.embed = NoiseEmbedding(ngf, emb)
        self.conv_in = nn.Conv2d(channels, ngf, 3, padding=1)
        self.enc_full = ResBlock(ngf, ngf, emb)
        self.down = nn.Conv2d(ngf, n2, 3, stride=2, padding=1)
        self.enc_half = ResBlock(n2, n2, emb)
        self.body = body
        if body == "deq":
            self.inject = nn.Linear(emb, n2)
            self.deq = (deq or DEQ)(EDMDEQMap(n2))
        else:
            self.mid = nn.ModuleList(ResBlock(n2, n2, emb) for _ in range(mid_blocks))
        self.dec_half = ResBlock(2 * n2, n2, emb)
        self.up = nn.Conv2d(n2, ngf, 3, padding=1)
        self.dec_full = ResBlock(2 * ngf, ngf, emb)
        self.norm_out, self.conv_out = nn.GroupNorm(_groups(ngf), ngf), nn.Conv2d(ngf, channels, 3, padding=1)

    def middle(self, h: Tensor, emb: Tensor) -> Tensor:
        if self.body == "deq":
            return self.deq(h + self.inject(emb)[:, :, None, None])
        for block in self.mid:
            h = block(h, emb)
        return h

    def forward(self, x: Tensor, c_noise: Tensor) -> Tensor:
        emb = self.embed(c_noise)
        full = self.enc_full(self.conv_in(x), emb)
        half = self.enc_half(self.down(full), emb)
        h = self.dec_half(torch.cat([self.middle(half, emb), half], 1), emb)
        h = self.up(F.interpolate(h, size=full.shape[2:], mode="nearest"))
        h = self.dec_full(torch.cat([h, full], 1), emb)
        return self.conv_out(F.silu(self.norm_out(h)))


class EDM(nn.Module):
    """EDM denoiser ``D(x; sigma)`` for images flattened ``[B, dim]`` (or ``[B, C, H, W]``) in ``[-1, 1]``; see the
    module docstring.

    Args:
        dim: values per image, ``channels * side^2`` (linked from the data module).
        channels: image channels.
        ngf: base width (the half-resolution features have ``2 ngf``).
        body: ``"unet"`` (explicit middle) or ``"deq"`` (a fixed point in the middle).
        mid_blocks: residual blocks of the explicit middle.
        sigma_data: the data's standard deviation in the preconditioning (0.5 for images in ``[-1, 1]``).
        deq: the DEQ layer of ``body="deq"``, called with its fixed-point map (default: DEQ's options).
    """

    def __init__(
        self,
        dim: int,  # values per image (linked from the data module)
        channels: int = 1,  # image channels: 1 for MNIST
        ngf: int = 32,  # base number of feature maps
        body: Literal["unet", "deq"] = "unet",  # explicit middle or a DEQ fixed point
        mid_blocks: int = 2,  # residual blocks of the explicit middle (body="unet")
        sigma_data: float = 0.5,  # data standard deviation in the preconditioning (images in [-1, 1])
        deq: DEQFactory | None = None,  # DEQ layer options (body="deq"); None: DEQ's defaults
    ):
        super().__init__()
        if body not in EDM_BODIES:
            raise choice_error("EDM body", body, EDM_BODIES)
        check_count("EDM dim", dim)
        check_count("EDM ngf", ngf)
        check_count("EDM mid_blocks", mid_blocks, low=0)
        self.side = image_side(dim, channels, "EDM")
        if self.side % 2:
            raise ConfigError(f"EDM halves the resolution once: the image side must be even, got {self.side}")
        if deq is not None and body != "deq":
            raise ConfigError("EDM deq options apply only to body 'deq'")
        self.dim, self.channels, self.body_kind, self.sigma_data = dim, channels, body, sigma_data
        self.denoiser = Preconditioned(UNet(channels, ngf, body, mid_blocks, deq), sigma_data)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.side, self.side)

    def forward(self, x: Tensor, sigma: Tensor) -> Tensor:
        """``D(x; sigma)`` at ``x`` (``[B, dim]`` or ``[B, C, H, W]``) and noise level ``sigma`` (``[B]``)."""
        out = self.denoiser(as_images(x, self.image_shape, "EDM"), sigma)
        return out.reshape(x.shape)
