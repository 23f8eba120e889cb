"""Noise-conditional score networks: NCSNv2, its shallow explicit baseline and a DEQ body (docs/method.md 4.4).

``NCSN(x, sigma)`` returns ``s(x, sigma) ~ grad_x log p_sigma(x)`` for images in ``[0, 1]`` (flattened ``[B, dim]``
or ``[B, C, H, W]``; the output has the input's shape). As NCSNv2, the network is unconditional apart from a
final division by ``sigma``: ``h = 2x - 1`` (unless ``centered``), ``begin_conv`` (C -> ngf), a body, instance
norm++, ELU, ``end_conv`` (ngf -> C), ``/ sigma``. Bodies (``body=``):

* ``"ncsnv2"``: the full NCSNv2 body, four stages of two residual blocks (the second halves the resolution, the
  third and fourth are dilated by 2 and 4) and four RefineNet blocks.
* ``"shallow"``: the explicit baseline, residual blocks ngf -> 2 ngf (dilation 2) and 2 ngf -> 2 ngf
  (dilation 4) at full resolution, one RefineNet block on ``[that, begin_conv output]``.
* ``"deq"`` (:class:`DEQBody`): a weight-tied residual block inside :class:`deqscore.deq.DEQ` at half resolution,
  ``z* = RB(z*) / w + u``, ``w = 2 ||conv1||_F ||conv2||_F``; ``"deq_full"`` (:class:`FullResDEQBody`) the reference
  design, the fixed point at full resolution. The reference code's pre-step applied the block twice
  (``RB(RB(z*)) / w``: the re-attached state is not the fixed point); ``double_prestep=True`` reproduces it.

DSM and FD-SSM need only first derivatives of the output through the DEQ, so ``backward="ift"`` is exact there;
SSM-VR differentiates the output with respect to x and needs ``"phantom"`` (the Lightning module refuses IFT).

>>> import torch
>>> net = NCSN(dim=3 * 8 * 8, channels=3, ngf=4, body="shallow")
>>> x, sigma = torch.rand(2, 3 * 8 * 8), torch.tensor([1.0, 0.1])
>>> net(x, sigma).shape
torch.Size([2, 192])
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..deq import DEQ, DEQFactory
from ..errors import ConfigError, check_count, choice_error
from .common import as_images, image_side

NCSN_BODIES = ("ncsnv2", "shallow", "deq", "deq_full")


# ---------------------------------------------------------------- NCSNv2 building blocks


class InstanceNorm2dPlus(nn.Module):
    """Instance norm++ (Song & Ermon 2020): instance norm plus the normalised channel means, so that the colour
    shift an instance norm removes is kept: ``gamma * (IN(x) + alpha * m~) + beta``."""

    def __init__(self, features: int):
        super().__init__()
        self.norm = nn.InstanceNorm2d(features, affine=False, track_running_stats=False)
        self.alpha = nn.Parameter(torch.empty(features).normal_(1.0, 0.02))
        self.gamma = nn.Parameter(torch.empty(features).normal_(1.0, 0.02))
        self.beta = nn.Parameter(torch.zeros(features))

    def forward(self, x: Tensor) -> Tensor:
        means = x.mean(dim=(2, 3))  # [B, C]
        m, v = means.mean(-1, keepdim=True), means.var(-1, keepdim=True)
        means = (means - m) / torch.sqrt(v + 1e-5)
        h = self.norm(x) + means[..., None, None] * self.alpha[:, None, None]
        return self.gamma[:, None, None] * h + self.beta[:, None, None]


class _ELUFunction(torch.autograd.Function):
    """ELU (alpha 1) as ``relu(x) + exp(min(x, 0)) - 1``; its backward is torch's own ``elu_backward`` on the input,
    so every derivative order is nn.ELU's."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.exp(x.clamp(max=0)).sub_(1).add_(F.relu(x))

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor], output: Tensor) -> None:  # the torch.func-ready form
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.elu_backward(grad, 1.0, 1, 1.0, False, x)


class ELU(nn.Module):
    """nn.ELU's values (to 6e-8, float32's spacing at 1, where ``exp(x) - 1`` rounds off what ``expm1`` keeps) and
    derivatives, at the same saved memory (the input). Torch's CPU elu kernel evaluates ``expm1``, about 6x slower
    than ``exp`` and ELU alone was a quarter of an NCSN step on one core. Other devices keep torch's fused kernel."""

    def forward(self, x: Tensor) -> Tensor:
        return _ELUFunction.apply(x) if x.device.type == "cpu" else F.elu(x)


def max_pool5(x: Tensor) -> Tensor:
    """5x5 max pooling at stride 1, padding 2, computed in the channels-last layout: the same values, indices and
    gradients as in the default layout, whose CPU kernel is about 8x slower (an NCSN step's second-largest cost)."""
    return F.max_pool2d(x.contiguous(memory_format=torch.channels_last), 5, stride=1, padding=2).contiguous()


def conv3x3(c_in: int, c_out: int, bias: bool = True, dilation: int = 1) -> nn.Conv2d:
    """3x3 convolution keeping the resolution (padding = dilation)."""
    return nn.Conv2d(c_in, c_out, 3, padding=dilation, dilation=dilation, bias=bias)


def mean_pool2(x: Tensor) -> Tensor:
    """``F.avg_pool2d(x, 2)`` as the mean of four strided slices, for which autograd saves nothing (``avg_pool2d``
    keeps its full-resolution input alive for its backward)."""
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    x = x[..., :h, :w]
    return (x[..., ::2, ::2] + x[..., 1::2, ::2] + x[..., ::2, 1::2] + x[..., 1::2, 1::2]) / 4


class ConvMeanPool(nn.Module):
    """Convolution (resolution kept) then 2x2 mean pooling (:func:`mean_pool2`, which records no activation)."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size, padding=kernel_size // 2)

    def forward(self, x: Tensor) -> Tensor:
        return mean_pool2(self.conv(x))


class ResidualBlock(nn.Module):
    """Pre-activation residual block (norm, ELU, conv, norm, ELU, conv, plus a shortcut); ``resample="down"``
    halves the resolution unless ``dilation > 1`` (NCSNv2's dilated "down" blocks only change the channels)."""

    def __init__(self, c_in: int, c_out: int, resample: Literal["down"] | None = None, dilation: int = 1):
        super().__init__()
        self.norm1, self.act = InstanceNorm2dPlus(c_in), ELU()
        down = resample == "down"
        if dilation > 1 or not down:
            mid = c_in if down else c_out
            self.conv1 = conv3x3(c_in, mid, dilation=dilation)
            self.conv2 = conv3x3(mid, c_out, dilation=dilation)
            shortcut = partial(conv3x3, dilation=dilation) if dilation > 1 else partial(nn.Conv2d, kernel_size=1)
        else:
            mid = c_in
            self.conv1 = conv3x3(c_in, mid)
            self.conv2 = ConvMeanPool(mid, c_out, 3)
            shortcut = partial(ConvMeanPool, kernel_size=1)
        self.norm2 = InstanceNorm2dPlus(mid)
        self.shortcut = shortcut(c_in, c_out) if (c_out != c_in or down) else None

    def residual(self, x: Tensor) -> Tensor:
        """The block without its shortcut."""
        h = self.conv1(self.act(self.norm1(x)))
        return self.conv2(self.act(self.norm2(h)))

    def forward(self, x: Tensor) -> Tensor:
        return (x if self.shortcut is None else self.shortcut(x)) + self.residual(x)


class RCUBlock(nn.Module):
    """Residual conv units: ``n_blocks`` times ``x <- x + conv(ELU(... conv(ELU(x))))`` with ``n_stages`` bias-free
    convolutions."""

    def __init__(self, features: int, n_blocks: int, n_stages: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(*(m for _ in range(n_stages) for m in (ELU(), conv3x3(features, features, bias=False))))
            for _ in range(n_blocks)
        )

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


class CRPBlock(nn.Module):
    """Chained residual pooling: ELU, then ``n_stages`` times ``path <- conv(maxpool5(path))``, ``x <- x + path``."""

    def __init__(self, features: int, n_stages: int = 2):
        super().__init__()
        self.act = ELU()
        self.convs = nn.ModuleList(conv3x3(features, features, bias=False) for _ in range(n_stages))

    def forward(self, x: Tensor) -> Tensor:
        x = path = self.act(x)
        for conv in self.convs:
            path = conv(max_pool5(path))
            x = x + path
        return x


class MSFBlock(nn.Module):
    """Multi-resolution fusion: each input convolved to ``features`` channels, resized to one shape and summed."""

    def __init__(self, in_planes: list[int], features: int):
        super().__init__()
        self.convs = nn.ModuleList(conv3x3(c, features) for c in in_planes)

    def forward(self, xs: list[Tensor], shape: tuple[int, int]) -> Tensor:
        return sum(F.interpolate(conv(x), size=shape, mode="bilinear", align_corners=True)
                   for conv, x in zip(self.convs, xs, strict=True))


class RefineBlock(nn.Module):
    """RefineNet block: residual conv units per input, fusion to the first input's resolution, chained residual
    pooling, output units (3 for the last block). ``rcu_blocks=1`` gives the DEQ body's plain two-convolution
    residual units everywhere."""

    def __init__(self, in_planes: list[int], features: int, end: bool = False, rcu_blocks: int = 2):
        super().__init__()
        self.adapt = nn.ModuleList(RCUBlock(c, rcu_blocks) for c in in_planes)
        self.fuse = MSFBlock(in_planes, features) if len(in_planes) > 1 else None
        self.crp = CRPBlock(features)
        self.out = RCUBlock(features, (3 if end else 1) if rcu_blocks > 1 else 1)

    def forward(self, xs: list[Tensor]) -> Tensor:
        hs = [adapt(x) for adapt, x in zip(self.adapt, xs, strict=True)]
        h = hs[0] if self.fuse is None else self.fuse(hs, tuple(xs[0].shape[2:]))
        return self.out(self.crp(h))


# ---------------------------------------------------------------- bodies


class NCSNv2Body(nn.Module):
    """The full NCSNv2 body (res1-res4 and four RefineNet blocks)."""

    def __init__(self, ngf: int):
        super().__init__()
        n2 = 2 * ngf
        self.res = nn.ModuleList([
            nn.Sequential(ResidualBlock(ngf, ngf), ResidualBlock(ngf, ngf)),
            nn.Sequential(ResidualBlock(ngf, n2, "down"), ResidualBlock(n2, n2)),
            nn.Sequential(ResidualBlock(n2, n2, "down", dilation=2), ResidualBlock(n2, n2, dilation=2)),
            nn.Sequential(ResidualBlock(n2, n2, "down", dilation=4), ResidualBlock(n2, n2, dilation=4)),
        ])
        self.refine = nn.ModuleList([
            RefineBlock([n2], n2), RefineBlock([n2, n2], n2), RefineBlock([n2, n2], ngf),
            RefineBlock([ngf, ngf], ngf, end=True),
        ])

    def forward(self, h: Tensor) -> Tensor:
        layers = []
        for res in self.res:
            h = res(h)
            layers.append(h)
        out = self.refine[0]([layers[3]])
        for refine, skip in zip(self.refine[1:], reversed(layers[:3]), strict=True):
            out = refine([skip, out])
        return out


class ShallowBody(nn.Module):
    """The explicit baseline: two dilated residual blocks and one RefineNet block with the input as skip."""

    def __init__(self, ngf: int):
        super().__init__()
        n2 = 2 * ngf
        self.res = nn.Sequential(ResidualBlock(ngf, n2, "down", dilation=2), ResidualBlock(n2, n2, "down", dilation=4))
        self.refine = RefineBlock([n2, ngf], ngf, end=True)

    def forward(self, h: Tensor) -> Tensor:
        return self.refine([self.res(h), h])


class NCSNDEQMap(nn.Module):
    """``F(z, u) = RB(z) / w + u``, ``w = 2 (||conv1||_F ||conv2||_F + 1e-12)`` from the current weights. The norm
    layers and the shortcut make no hard contraction guarantee (docs/method.md 2.2): the solver's statistics are
    logged."""

    additive_injection = True  # f(z, u) = h(z) + u: the implicit backward saves no copy of u

    def __init__(self, ngf: int, grad_through_norm: bool = False, double_prestep: bool = False):
        super().__init__()
        self.block = ResidualBlock(ngf, ngf)
        self.grad_through_norm, self.double_prestep = grad_through_norm, double_prestep

    def norm_scalar(self) -> Tensor:
        w = 2 * (self.block.conv1.weight.norm() * self.block.conv2.weight.norm() + 1e-12)
        return w if self.grad_through_norm else w.detach()

    def forward(self, z: Tensor, u: Tensor) -> Tensor:
        return self.block(z) / self.norm_scalar() + u

    def prestep_residual(self, z: Tensor, u: Tensor) -> Tensor:
        """``RB(z) / w``, or ``RB(RB(z)) / w`` with ``double_prestep`` (see :class:`deqscore.deq.DEQ`)."""
        h = self.block(self.block(z)) if self.double_prestep else self.block(z)
        return h / self.norm_scalar()


class FullResDEQBody(nn.Module):
    """The reference DEQ body (``body="deq_full"``): a fixed point at full resolution, two residual blocks, two light
    RefineNet blocks."""

    def __init__(self, ngf: int, deq: DEQFactory, grad_through_norm: bool = False, double_prestep: bool = False):
        super().__init__()
        self.deq = deq(NCSNDEQMap(ngf, grad_through_norm, double_prestep))
        self.res = nn.Sequential(ResidualBlock(ngf, ngf), ResidualBlock(ngf, 2 * ngf))
        self.refine1 = RefineBlock([2 * ngf, ngf], ngf, rcu_blocks=1)
        self.refine2 = RefineBlock([ngf, ngf], ngf, end=True, rcu_blocks=1)

    def forward(self, u: Tensor) -> Tensor:
        z = self.deq(u)
        return self.refine2([self.refine1([self.res(z), z]), u])


class DEQBody(nn.Module):
    """The DEQ body (``body="deq"``): a down block (ngf -> 2 ngf), the fixed point there, and one RefineNet block of
    plain units fusing ``z*`` with the full-resolution skip. Every tensor the fixed point records is half the size
    of a full-resolution ``ngf`` map."""

    def __init__(self, ngf: int, deq: DEQFactory, grad_through_norm: bool = False, double_prestep: bool = False):
        super().__init__()
        self.down = ResidualBlock(ngf, 2 * ngf, "down")
        self.deq = deq(NCSNDEQMap(2 * ngf, grad_through_norm, double_prestep))
        self.refine = RefineBlock([ngf, 2 * ngf], ngf, end=True, rcu_blocks=1)

    def forward(self, h: Tensor) -> Tensor:
        return self.refine([h, self.deq(self.down(h))])


# ---------------------------------------------------------------- the network


class NCSN(nn.Module):
    """Noise-conditional score network ``s(x, sigma)``; see the module docstring.

    Args:
        dim: values per image, ``channels * side^2`` (linked from the data module).
        channels: image channels.
        ngf: base width (128 in NCSNv2 on CIFAR-10).
        body: ``"ncsnv2"``, ``"shallow"``, ``"deq"`` (fixed point at half resolution) or ``"deq_full"`` (the
            reference design, fixed point at full resolution).
        deq: the DEQ layer of the DEQ bodies, called with its fixed-point map (default: DEQ's options).
        grad_through_norm: differentiate the DEQ map's normaliser ``w`` (reference: no).
        double_prestep: the reference's pre-step ``RB(RB(z*)) / w`` (needs the DEQ's ``injection_prestep``).
        centered: inputs already in ``[-1, 1]`` (otherwise ``h = 2x - 1`` for data in ``[0, 1]``).
    """

    def __init__(
        self,
        dim: int,  # values per image (linked from the data module)
        channels: int = 3,  # image channels: 1 for MNIST, 3 for CIFAR-10 / CelebA
        ngf: int = 128,  # base number of feature maps
        body: Literal["ncsnv2", "shallow", "deq", "deq_full"] = "deq",  # the network between begin_conv and the head
        deq: DEQFactory | None = None,  # DEQ layer options (body="deq"); None: DEQ's defaults
        grad_through_norm: bool = False,  # gradient through the DEQ map's normaliser w (reference: no)
        double_prestep: bool = False,  # the reference's double block application in the pre-step
        centered: bool = False,  # inputs in [-1, 1] already (else 2x - 1)
    ):
        super().__init__()
        if body not in NCSN_BODIES:
            raise choice_error("NCSN body", body, NCSN_BODIES)
        check_count("NCSN dim", dim)
        check_count("NCSN ngf", ngf)
        self.side = image_side(dim, channels, "NCSN")
        if body in ("ncsnv2", "deq") and self.side % 2:
            raise ConfigError(f"NCSN body '{body}' halves the resolution once: the image side must be even, got "
                              f"{self.side}")
        if double_prestep and body not in ("deq", "deq_full"):
            raise ConfigError("NCSN double_prestep applies only to the DEQ bodies ('deq', 'deq_full')")
        self.dim, self.channels, self.body_kind, self.centered = dim, channels, body, centered
        self.begin_conv = conv3x3(channels, ngf)
        if body == "ncsnv2":
            self.body = NCSNv2Body(ngf)
        elif body == "shallow":
            self.body = ShallowBody(ngf)
        else:
            deq_body = DEQBody if body == "deq" else FullResDEQBody
            self.body = deq_body(ngf, deq or DEQ, grad_through_norm, double_prestep)
            if double_prestep and not self.body.deq.injection_prestep:
                raise ConfigError("NCSN double_prestep needs the DEQ option injection_prestep: true (it changes "
                                  "only the pre-step)")
        self.head = nn.Sequential(InstanceNorm2dPlus(ngf), ELU(), conv3x3(ngf, channels))

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.side, self.side)

    def forward(self, x: Tensor, sigma: Tensor) -> Tensor:
        """Score at ``x`` (``[B, dim]`` or ``[B, C, H, W]``) and per-sample noise level ``sigma`` (``[B]``)."""
        h = as_images(x, self.image_shape, "NCSN")
        sigma = torch.as_tensor(sigma, dtype=x.dtype, device=x.device).expand(x.shape[0])
        h = self.begin_conv(h if self.centered else 2 * h - 1)
        out = self.head(self.body(h)) / sigma.view(-1, 1, 1, 1)
        return out.reshape(x.shape)
