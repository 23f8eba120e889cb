"""VAEs whose encoder is implicit, ``z = q(x, eps)``, with the entropy gradient from a score network trained by
sliced score matching (docs/method.md sections 3.8, 4.3); and the ordinary Gaussian-encoder VAE as a baseline.

The implicit encoder has no density, so the ELBO's entropy term is handled by a score network
``s(x, z) ~ grad_z log q(z | x)`` trained by SSM-VR on encoder samples. The encoder/decoder then minimise, per sample,

    l = -log p(x | z) - log N(z; 0, I) + s(x, z).detach() . z,       z = q(x, eps)

whose gradient in the encoder's parameters is that of the negative ELBO, since ``grad E_q[log q(z|x)]`` is
``E[(grad_z log q)(z) . dz/dphi]`` for reparameterised ``z`` (the score of q has mean zero under q). ``l`` is a
surrogate with the right gradient, not a bound; it is logged as ``surrogate``.

Networks (``arch=``): ``"mlp"`` for binarised MNIST (784 -> 256 -> 256 tanh, as the sliced-score-matching code),
``"conv"`` for 32x32 / 64x64 RGB (5x5 convolutions, stride 2, down to 4x4; Gaussian decoder with fixed
``log_std = -0.602``). Score networks (``score=``): ``"explicit"`` or ``"deq"`` (a fixed point ``h = SP(W h)/w + u``
for the MLP, ``h = SP(conv_W h)/w + u`` at full resolution for the conv net, with ``w = C (||W||_F + 1e-6)``).

>>> import torch
>>> vae = ImplicitVAE(dim=784, z_dim=4, eps_dim=4, hidden=16, score="explicit")
>>> x = torch.rand(3, 784).bernoulli()
>>> vae.surrogate(x).shape, vae.score_loss(x).shape
(torch.Size([3]), torch.Size([3]))
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..deq import DEQ, DEQFactory, require_backward
from ..errors import ConfigError, check_count, check_real, choice_error
from ..losses import sliced_score_matching
from .common import image_side

VAE_ARCHS = ("mlp", "conv")
SCORE_NETS = ("explicit", "deq", "deq_full")
GAUSSIAN_LOG_STD = -0.602  # the conv decoder's fixed output log standard deviation (std 0.548)
LOG_2PI = math.log(2 * math.pi)


def log_standard_normal(z: Tensor) -> Tensor:
    """``log N(z; 0, I)`` per sample."""
    return -0.5 * (z.pow(2) + LOG_2PI).flatten(1).sum(1)


# ---------------------------------------------------------------- MLP (binarised MNIST)


def tanh_mlp(d_in: int, hidden: int, d_out: int, layers: int = 2) -> nn.Sequential:
    """``d_in -> hidden -> ... -> hidden (tanh) -> d_out`` with ``layers`` hidden layers."""
    dims = [d_in] + [hidden] * layers
    body = [m for a, b in zip(dims, dims[1:], strict=False) for m in (nn.Linear(a, b), nn.Tanh())]
    return nn.Sequential(*body, nn.Linear(hidden, d_out))


class MLPDEQScoreMap(nn.Module):
    """``F(h, u) = SP(W h) / w + u``, ``w = C (||W||_F + 1e-6)`` (no gradient through w): ``1/C``-contractive."""

    additive_injection = True  # f(z, u) = h(z) + u: the implicit backward saves no copy of u

    def __init__(self, hidden: int, norm_scale: float):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden, bias=False)
        self.norm_scale = norm_scale

    def forward(self, h: Tensor, u: Tensor) -> Tensor:
        w = self.norm_scale * (self.lin.weight.norm().detach() + 1e-6)
        return F.softplus(self.lin(h)) / w + u


class MLPScore(nn.Module):
    """``s(x, z)``: explicit ``[x, z] -> 256 -> 256 (tanh) -> z``, or DEQ ``u = SP(Linear [x, z])``, fixed point of
    :class:`MLPDEQScoreMap`, ``Linear -> z``."""

    def __init__(self, dim: int, z_dim: int, hidden: int, kind: str, deq: DEQFactory, norm_scale: float,
                 layers: int = 2):
        super().__init__()
        self.kind = kind
        if kind == "explicit":
            self.net = tanh_mlp(dim + z_dim, hidden, z_dim, layers)
        else:
            self.inject = nn.Linear(dim + z_dim, hidden)
            self.deq = deq(MLPDEQScoreMap(hidden, norm_scale))
            self.head = nn.Linear(hidden, z_dim)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        xz = torch.cat([x.flatten(1), z], 1)
        if self.kind == "explicit":
            return self.net(xz)
        return self.head(self.deq(F.softplus(self.inject(xz))))


# ---------------------------------------------------------------- conv (32x32 / 64x64 RGB)


def _downs(side: int) -> int:
    """Stride-2 convolutions from ``side`` down to 4x4."""
    n = int(round(math.log2(side / 4)))
    if n < 1 or 4 * 2**n != side:
        raise ConfigError(f"VAE arch 'conv' needs a square image side 4 * 2^k (32, 64), got {side}")
    return n


def _conv(c_in: int, c_out: int, stride: int = 2, k: int = 5, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=bias)


def _down_stack(widths: list[int], act: type[nn.Module]) -> nn.Sequential:
    """Stride-2 5x5 convolutions ``widths[i] -> widths[i + 1]``, each followed by ``act``."""
    return nn.Sequential(*(m for a, b in zip(widths, widths[1:], strict=False) for m in (_conv(a, b), act())))


class ConvEncoder(nn.Module):
    """``eps -> FC -> side x side`` map (BN, ReLU) as an extra channel, stride-2 5x5 convolutions (ReLU) with
    nef * (1, 2, 4, ...) channels down to 4x4, FC 512 (ReLU), FC z."""

    def __init__(self, channels: int, side: int, z_dim: int, eps_dim: int, nef: int):
        super().__init__()
        n, self.side = _downs(side), side
        self.eps_map = nn.Sequential(nn.Linear(eps_dim, side * side), nn.BatchNorm1d(side * side), nn.ReLU())
        widths = [channels + 1] + [nef * 2**i for i in range(n)]
        self.convs = _down_stack(widths, nn.ReLU)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(widths[-1] * 16, 512), nn.ReLU(), nn.Linear(512, z_dim))

    def forward(self, x: Tensor, eps: Tensor) -> Tensor:
        e = self.eps_map(eps).view(-1, 1, self.side, self.side)
        return self.head(self.convs(torch.cat([x, e], 1)))


class ConvDecoder(nn.Module):
    """``FC z -> (nef 2^(n-1)) x 4 x 4``, transposed 5x5 stride-2 convolutions halving the channels (ReLU), the
    last to the image channels, tanh: the mean of a Gaussian in [-1, 1] pixel space."""

    def __init__(self, channels: int, side: int, z_dim: int, nef: int):
        super().__init__()
        n = _downs(side)
        self.top = nef * 2 ** (n - 1)
        self.fc = nn.Linear(z_dim, self.top * 16)
        widths = [nef * 2**i for i in reversed(range(n))] + [channels]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
            layers += [nn.ConvTranspose2d(a, b, 5, stride=2, padding=2, output_padding=1)]
            layers += [nn.ReLU()] if i < n - 1 else [nn.Tanh()]
        self.deconvs = nn.Sequential(*layers)

    def forward(self, z: Tensor) -> Tensor:
        return self.deconvs(F.relu(self.fc(z)).view(-1, self.top, 4, 4))


class ConvDEQScoreMap(nn.Module):
    """``F(h, u) = SP(conv_W(h)) / w + u``, a k x k convolution without bias, ``w = C (||W||_F + 1e-6)`` (no
    gradient; ``C > k`` bounds the Lipschitz constant of a k x k convolution below 1, docs/method.md 2.2)."""

    additive_injection = True  # f(z, u) = h(z) + u: the implicit backward saves no copy of u

    def __init__(self, nef: int, norm_scale: float, kernel_size: int = 5):
        super().__init__()
        self.conv = _conv(nef, nef, stride=1, k=kernel_size, bias=False)
        self.norm_scale = norm_scale

    def forward(self, h: Tensor, u: Tensor) -> Tensor:
        w = self.norm_scale * (self.conv.weight.norm().detach() + 1e-6)
        return F.softplus(self.conv(h)) / w + u


class ConvScore(nn.Module):
    """``s(x, z)``: z as an extra ``side x side`` channel (FC, BN, SP), then one of

    * ``"explicit"``: stride-2 5x5 convolutions with nef * (1, 2, 4, ...) channels down to 4x4, FC 512, Linear z;
    * ``"deq"``: a 4x4 stride-4 convolution (a patch embedding) to ``side / 4`` with 2 nef channels, the fixed point
      of :class:`ConvDEQScoreMap` there (3x3 convolution), then the explicit net's remaining stride-2 convolutions
      (4 nef, 8 nef, ... channels) down to 4x4, FC 512, Linear z. The fixed point takes the place of the explicit
      net's first two layers at the resolution of its second, so it records a fraction of the explicit net's
      activations, and its parameters are fewer;
    * ``"deq_full"`` (the reference design): ``u = SP(conv(x, z-map))``, the fixed point of
      :class:`ConvDEQScoreMap` (5x5) at full resolution with nef channels, a residual ``SP(conv h) + h``, three
      stride-2 convolutions with 2nef, 4nef, 8nef channels (to side / 8), FC 512, Linear z.
    """

    def __init__(self, channels: int, side: int, z_dim: int, nef: int, kind: str, deq: DEQFactory,
                 norm_scale: float):
        super().__init__()
        n, self.side, self.kind = _downs(side), side, kind
        self.z_map = nn.Sequential(nn.Linear(z_dim, side * side), nn.BatchNorm1d(side * side), nn.Softplus())
        if kind == "explicit":
            widths = [channels + 1] + [nef * 2**i for i in range(n)]
        elif kind == "deq":
            if n < 2:
                raise ConfigError(f"VAE score 'deq' (conv) embeds 4x4 patches: the image side must be at least 16, "
                                  f"got {side}; use score 'explicit'")
            self.inject = nn.Conv2d(channels + 1, 2 * nef, 4, stride=4)
            self.deq = deq(ConvDEQScoreMap(2 * nef, norm_scale, kernel_size=3))
            widths = [nef * 2**i for i in range(1, n)]
        else:
            self.inject = _conv(channels + 1, nef, stride=1)
            self.deq = deq(ConvDEQScoreMap(nef, norm_scale))
            self.refine = _conv(nef, nef, stride=1)
            widths = [nef * 2**i for i in range(4)]
        out_side = side // 2 ** (len(widths) - 1) // (4 if kind == "deq" else 1)
        self.convs = _down_stack(widths, nn.Softplus)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(widths[-1] * out_side**2, 512), nn.Softplus(),
                                  nn.Linear(512, z_dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        h = torch.cat([x, self.z_map(z).view(-1, 1, self.side, self.side)], 1)
        if self.kind == "deq":
            h = self.deq(self.inject(h))
        elif self.kind == "deq_full":
            h = self.deq(F.softplus(self.inject(h)))
            h = F.softplus(self.refine(h)) + h
        return self.head(self.convs(h))


# ---------------------------------------------------------------- the VAEs


def _check(dim: int, channels: int, arch: str, z_dim: int, eps_dim: int, hidden: int) -> int | None:
    """Common option checks; the image side for ``arch="conv"``."""
    if arch not in VAE_ARCHS:
        raise choice_error("VAE arch", arch, VAE_ARCHS)
    for key, value in (("dim", dim), ("channels", channels), ("z_dim", z_dim), ("eps_dim", eps_dim),
                       ("hidden", hidden)):
        check_count(f"VAE {key}", value)
    if arch == "mlp":
        return None
    side = image_side(dim, channels, "VAE")
    _downs(side)
    return side


class _Decoding(nn.Module):
    """Decoder, likelihood and prior shared by both VAEs; data ``x`` in [0, 1] (binary for the MLP)."""

    def _build_decoder(self, arch: str, dim: int, channels: int, side: int | None, z_dim: int, hidden: int,
                       nef: int) -> None:
        self.arch, self.dim, self.channels, self.side, self.z_dim = arch, dim, channels, side, z_dim
        self.decoder = tanh_mlp(z_dim, hidden, dim) if arch == "mlp" else ConvDecoder(channels, side, z_dim, nef)

    def net_input(self, x: Tensor) -> Tensor:
        """MLP: ``[B, dim]``; conv: ``[B, C, H, W]`` in [-1, 1]."""
        if x.dim() < 2 or x[0].numel() != self.dim:
            raise ValueError(f"the VAE expects inputs with {self.dim} values each, got shape {tuple(x.shape)}")
        return x.flatten(1) if self.arch == "mlp" else 2 * x.reshape(-1, self.channels, self.side, self.side) - 1

    def log_likelihood(self, x: Tensor, z: Tensor) -> Tensor:
        """``log p(x | z)`` per sample: Bernoulli (MLP, binary x) or Gaussian in [-1, 1] space with fixed std."""
        out = self.decoder(z)
        target = self.net_input(x)
        if self.arch == "mlp":
            return -F.binary_cross_entropy_with_logits(out, target, reduction="none").sum(1)
        var = math.exp(2 * GAUSSIAN_LOG_STD)
        return -0.5 * ((target - out).pow(2) / var + 2 * GAUSSIAN_LOG_STD + LOG_2PI).flatten(1).sum(1)

    def log_joint(self, x: Tensor, z: Tensor) -> Tensor:
        """``log p(x | z) + log N(z; 0, I)`` per sample (the target of AIS)."""
        return self.log_likelihood(x, z) + log_standard_normal(z)

    @torch.no_grad()
    def decode_mean(self, z: Tensor) -> Tensor:
        """The decoder's mean image for ``z``, as ``[B, dim]`` in [0, 1]."""
        out = self.decoder(z)
        return torch.sigmoid(out) if self.arch == "mlp" else ((out + 1) / 2).clamp(0, 1).flatten(1)


class ImplicitVAE(_Decoding):
    """VAE with the implicit encoder ``z = q(x, eps)`` and a score network for its entropy gradient.

    Args:
        dim: values per image (linked from the data module).
        channels: image channels (``arch="conv"``).
        arch: ``"mlp"`` or ``"conv"``.
        z_dim, eps_dim: latent and encoder-noise sizes.
        hidden: MLP width.
        nef: base channels of the conv networks.
        score: ``"explicit"``, ``"deq"`` or (conv) ``"deq_full"``, the reference design with its fixed point at
            full resolution (see :class:`ConvScore`).
        deq: DEQ layer options of the DEQ score network (``backward="ift"`` is refused: SSM-VR is second-order).
        norm_scale: C of the DEQ map's normaliser ``w = C (||W||_F + 1e-6)``; the map contracts when C exceeds
            the map's bound (1 for the MLP, the kernel size k for a k x k convolution: 3 for ``"deq"``, 5 for
            ``"deq_full"``), and smaller values are refused. None: twice the bound (a contraction factor of at
            most 1/2).
        n_projections: projection vectors of the score network's SSM-VR loss.
        score_layers: hidden layers of the explicit MLP score network (2: the reference's).
    """

    def __init__(
        self,
        dim: int,  # values per image (linked from the data module)
        channels: int = 1,  # image channels (conv)
        arch: Literal["mlp", "conv"] = "mlp",  # network family
        z_dim: int = 8,  # latent size
        eps_dim: int = 8,  # encoder noise size
        hidden: int = 256,  # MLP width
        nef: int = 64,  # conv base channels
        score: Literal["explicit", "deq", "deq_full"] = "deq",  # score network of the entropy gradient
        deq: DEQFactory | None = None,  # DEQ layer options (the DEQ score networks)
        norm_scale: float | None = None,  # C of w = C (||W||_F + 1e-6); None: twice the map's contraction bound
        n_projections: int = 1,  # projections of the score network's SSM-VR loss
        score_layers: int = 2,  # hidden layers of the explicit MLP score network
    ):
        super().__init__()
        side = _check(dim, channels, arch, z_dim, eps_dim, hidden)
        if score not in SCORE_NETS:
            raise choice_error("VAE score", score, SCORE_NETS)
        if score == "deq_full" and arch != "conv":
            raise ConfigError("VAE score 'deq_full' is the conv reference design (fixed point at full resolution); "
                              "for arch 'mlp' use score 'deq'")
        norm_scale = _norm_scale(arch, score, norm_scale)
        check_count("VAE n_projections", n_projections)
        check_count("VAE score_layers", score_layers)
        if score_layers != 2 and (arch, score) != ("mlp", "explicit"):
            raise ConfigError(f"VAE score_layers sets the depth of the explicit MLP score network (arch 'mlp', score "
                              f"'explicit'); got arch {arch!r}, score {score!r}")
        self._build_decoder(arch, dim, channels, side, z_dim, hidden, nef)
        self.eps_dim, self.score_kind, self.n_projections = eps_dim, score, n_projections
        if arch == "mlp":
            self.encoder = tanh_mlp(dim + eps_dim, hidden, z_dim)
            self.score = MLPScore(dim, z_dim, hidden, score, deq or DEQ, norm_scale, score_layers)
        else:
            self.encoder = ConvEncoder(channels, side, z_dim, eps_dim, nef)
            self.score = ConvScore(channels, side, z_dim, nef, score, deq or DEQ, norm_scale)
        # SSM-VR differentiates the score network's output w.r.t. z, then the parameters
        require_backward(self.score, order=2, user="the VAE score network's SSM-VR loss")

    def ae_parameters(self) -> list[nn.Parameter]:
        """Encoder and decoder parameters (the surrogate's optimiser)."""
        return [*self.encoder.parameters(), *self.decoder.parameters()]

    def encode(self, x: Tensor, eps: Tensor | None = None) -> Tensor:
        """``z = q(x, eps)``, ``eps ~ N(0, I)`` unless given."""
        h = self.net_input(x)
        eps = torch.randn(h.shape[0], self.eps_dim, device=h.device, dtype=h.dtype) if eps is None else eps
        return self.encoder(torch.cat([h, eps], 1)) if self.arch == "mlp" else self.encoder(h, eps)

    def score_loss(self, x: Tensor) -> Tensor:
        """SSM-VR of ``s(x, .)`` on encoder samples, per sample; x and z are detached, so nothing reaches the
        encoder or decoder."""
        h = self.net_input(x).detach()
        with torch.no_grad():
            z = self.encode(x)
        def score_of_z(z_: Tensor) -> Tensor:  # z is repeated per projection: so is its conditioning x
            return self.score(h.repeat(len(z_) // len(h), *[1] * (h.dim() - 1)), z_)

        return sliced_score_matching(score_of_z, z, n_projections=self.n_projections, projection="gaussian",
                                     variance_reduction=True)

    def surrogate(self, x: Tensor) -> Tensor:
        """``-log p(x|z) - log N(z) + s(x, z).z`` per sample (score detached: no gradient reaches the score net)."""
        z = self.encode(x)
        with torch.no_grad():
            s = self.score(self.net_input(x), z.detach())
        return -self.log_joint(x, z) + (s * z).sum(1)


def _norm_scale(arch: str, score: str, norm_scale: float | None) -> float:
    """The DEQ map's C, checked against the bound above which the map contracts (a non-contractive map gives a
    fixed point the solver may not find and phantom gradients that do not approximate the implicit one)."""
    bound = 1.0 if arch == "mlp" else 3.0 if score == "deq" else 5.0
    if norm_scale is None:
        return 2 * bound
    check_real("VAE norm_scale", norm_scale)
    if score != "explicit" and norm_scale <= bound:
        raise ConfigError(f"VAE norm_scale must exceed {bound:g} for score {score!r} with arch {arch!r} (the DEQ "
                          f"map's Lipschitz bound is {bound:g} / norm_scale), got {norm_scale:g}")
    return norm_scale


class GaussianVAE(_Decoding):
    """The ordinary VAE: a Gaussian encoder ``N(mu(x), diag sigma^2(x))`` on the same trunk, trained on the ELBO
    (analytic KL); the baseline of the implicit-encoder VAE."""

    def __init__(
        self,
        dim: int,  # values per image (linked from the data module)
        channels: int = 1,
        arch: Literal["mlp", "conv"] = "mlp",
        z_dim: int = 8,
        hidden: int = 256,
        nef: int = 64,
    ):
        super().__init__()
        side = _check(dim, channels, arch, z_dim, 1, hidden)
        self._build_decoder(arch, dim, channels, side, z_dim, hidden, nef)
        if arch == "mlp":
            self.encoder = tanh_mlp(dim, hidden, 2 * z_dim)
        else:
            self.encoder = ConvEncoder(channels, side, 2 * z_dim, 1, nef)

    def ae_parameters(self) -> list[nn.Parameter]:
        return list(self.parameters())

    def posterior(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(mu, log_var)`` of q(z | x)."""
        h = self.net_input(x)
        out = self.encoder(h) if self.arch == "mlp" else self.encoder(h, torch.zeros(len(h), 1, device=h.device))
        return out.chunk(2, dim=1)

    def encode(self, x: Tensor) -> Tensor:
        mu, log_var = self.posterior(x)
        return mu + (0.5 * log_var).exp() * torch.randn_like(mu)

    def surrogate(self, x: Tensor) -> Tensor:
        """The negative ELBO per sample (one reparameterised sample, analytic KL)."""
        mu, log_var = self.posterior(x)
        z = mu + (0.5 * log_var).exp() * torch.randn_like(mu)
        kl = 0.5 * (mu.pow(2) + log_var.exp() - 1 - log_var).sum(1)
        return -self.log_likelihood(x, z) + kl
