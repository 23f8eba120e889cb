"""Pre-processing of 8-bit images for density models (docs/method.md section 4.1) and the bits/dim conversion.

Three pre-processing pipelines are provided; ``k`` is the uint8 pixel value and ``U ~ U(0, 1)``:

* **REF (clamp)**, used for training as in the reference code::

      x = k/255 + (U - 0.5)/256,   x <- clamp(x, alpha, 1 - alpha),   y = logit(x)

  (:func:`dequantize` then :func:`logit_transform`). The clamp is not invertible, so a pixel-space
  likelihood computed from it is only approximate.
* **Invertible squeeze** (docs/method.md section 4.1, "Evaluation"; the standard, comparable bits/dim)::

      x~ = (k + U)/256,   x' = alpha + (1 - 2 alpha) x~,   y = logit(x')

  (:func:`dequantize_squeeze` then :func:`logit_transform`); :func:`bits_per_dim` with the same ``alpha``
  accounts for the squeeze's Jacobian.
* **Pixels** (``"pixels"``), the input convention of score networks on images (NCSN: data in ``[0, 1]``)::

      x = k/255

  exactly: no noise, no clamp, no logit, ``alpha`` unused. The data stay on a discrete set of 256 values per
  dimension, so there is no density and no bits/dim (:meth:`ImageCodec.bits_per_dim` refuses).

:class:`ImageCodec` bundles a pipeline's name, ``alpha`` and the image shape: it turns model-space samples back
into images and log-densities into bits/dim, and is plain enough to be stored in a checkpoint.

Example:

>>> import torch
>>> imgs = torch.tensor([[0, 128, 255]], dtype=torch.uint8)
>>> x = dequantize(imgs, generator=torch.Generator().manual_seed(0))
>>> bool(((x - imgs / 255).abs() <= 1 / 512).all())
True
>>> y = logit_transform(x)
>>> torch.allclose(inverse_logit(y), x, atol=1e-6)
True
>>> round(float(logit_log_det(torch.full((1, 784), 0.5))[0]), 2)   # 784 * log 4
1086.85
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from einops import rearrange

__all__ = [
    "DEFAULT_ALPHA",
    "TRANSFORMS",
    "ImageCodec",
    "check_transform",
    "preprocess",
    "to_unit",
    "bits_per_dim",
    "dequantize",
    "dequantize_squeeze",
    "inverse_logit",
    "inverse_squeeze",
    "logit_log_det",
    "logit_transform",
]

#: Clamp / squeeze margin used by the reference code (``[1e-3, 1 - 1e-3]``).
DEFAULT_ALPHA = 1e-3
#: Names accepted by :func:`preprocess`: ``"logit"`` (REF clamp + logit), ``"unit"`` (REF clamp, no logit),
#: ``"logit_squeeze"`` (invertible squeeze + logit, for exact pixel-space bits/dim), ``"pixels"`` (``k/255``, no
#: noise: the score networks' convention, images in [0, 1]).
TRANSFORMS: tuple[str, ...] = ("logit", "unit", "logit_squeeze", "pixels")
#: transforms with no logit, for which alpha may be 0
_NO_LOGIT = ("unit", "pixels")


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha < 0.5:
        raise ValueError(f"alpha must lie in [0, 0.5), got {alpha}")


def _uniform_like(
    images: torch.Tensor, generator: torch.Generator | None, dtype: torch.dtype
) -> torch.Tensor:
    device = images.device if generator is None else generator.device
    u = torch.rand(images.shape, generator=generator, dtype=dtype, device=device)
    return u.to(images.device)


def dequantize(
    images: torch.Tensor,
    generator: torch.Generator | None = None,
    alpha: float = DEFAULT_ALPHA,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The reference dequantisation of integer images in ``0..255``: ``x = k/255 + (U - 0.5)/256`` clamped to
    ``[alpha, 1 - alpha]`` (``alpha = 0``: no margin). The noise is at most ``1/512``; the clamp only moves values
    towards the pixel."""
    _check_alpha(alpha)
    x = images.to(dtype) / 255.0
    x = x + (_uniform_like(images, generator, dtype) - 0.5) / 256.0
    return x.clamp_(alpha, 1.0 - alpha)


def dequantize_squeeze(
    images: torch.Tensor,
    generator: torch.Generator | None = None,
    alpha: float = DEFAULT_ALPHA,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Invertible dequantisation ``x' = alpha + (1 - 2 alpha) (k + U)/256``: ``(k + U)/256`` partitions ``[0, 1)``
    into the 256 pixel bins, and the affine squeeze keeps ``x'`` inside ``[alpha, 1 - alpha]`` without a clamp."""
    _check_alpha(alpha)
    x_tilde = (images.to(dtype) + _uniform_like(images, generator, dtype)) / 256.0
    return alpha + (1.0 - 2.0 * alpha) * x_tilde


def inverse_squeeze(x: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """Undo the squeeze of :func:`dequantize_squeeze`: ``x~ = (x' - alpha) / (1 - 2 alpha)``."""
    _check_alpha(alpha)
    return (x - alpha) / (1.0 - 2.0 * alpha)


def logit_transform(x: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """``y = log x - log(1 - x)`` after clamping ``x`` to ``[alpha, 1 - alpha]`` (a no-op on dequantised data)."""
    _check_alpha(alpha)
    x = x.clamp(alpha, 1.0 - alpha)
    return torch.log(x) - torch.log1p(-x)


def inverse_logit(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`logit_transform` (the logistic sigmoid)."""
    return torch.sigmoid(y)


def logit_log_det(x: torch.Tensor) -> torch.Tensor:
    """``log|det dy/dx|`` [B] of ``y = logit(x)``, ``x`` [B, ...] in ``(0, 1)``: ``sum_d -log x_d - log(1 - x_d)``."""
    return (-torch.log(x) - torch.log1p(-x)).reshape(x.shape[0], -1).sum(dim=1)


def bits_per_dim(
    log_prob_logit_space: torch.Tensor,
    x_unit: torch.Tensor,
    n_bins: int = 256,
    alpha: float = 0.0,
) -> torch.Tensor:
    """Convert a per-sample log-likelihood in logit space (nats) into bits/dim of the 8-bit pixel data.

    With ``y = logit(x_unit)`` the model input, ``D`` the number of dimensions per sample and ``alpha`` the
    margin of an invertible squeeze ``x_unit = alpha + (1 - 2 alpha) x~`` (``alpha = 0``: no squeeze,
    ``x~ = x_unit``)::

        log p(x~)  = log p(y) + sum_d [ -log x_unit_d - log(1 - x_unit_d) ] + D log(1 - 2 alpha)
        bits/dim   = -( log p(x~) - D ln(n_bins) ) / (D ln 2)

    ``log p(x~)`` is the density of the dequantised image on the unit cube; subtracting ``D ln(n_bins)``
    turns it into a density on the ``[0, n_bins)`` pixel scale (bins of width 1), whose expectation over the
    uniform dequantisation noise is a lower bound on the discrete log-likelihood (so bits/dim is an upper
    bound). Sanity value: the uniform density on the unit cube (``log p(x~) = 0``) gives exactly
    ``log2(n_bins) = 8`` bits/dim.

    For data pre-processed with :func:`dequantize_squeeze`, pass the same ``alpha``; for the reference clamp
    pipeline (:func:`dequantize`, ``alpha = 0`` here) the figure is approximate because the clamp is not
    invertible and the noise is centred on ``k/255`` rather than on the bin centres.
    """
    _check_alpha(alpha)
    if log_prob_logit_space.dim() != 1 or log_prob_logit_space.shape[0] != x_unit.shape[0]:
        raise ValueError(
            f"log_prob_logit_space must have shape [B] matching x_unit's batch size; got "
            f"{tuple(log_prob_logit_space.shape)} and {tuple(x_unit.shape)}"
        )
    dims = x_unit[0].numel()
    log_p_unit = log_prob_logit_space + logit_log_det(x_unit).to(log_prob_logit_space.dtype)
    if alpha > 0.0:
        log_p_unit = log_p_unit + dims * math.log1p(-2.0 * alpha)
    return -(log_p_unit - dims * math.log(n_bins)) / (dims * math.log(2.0))


def check_transform(name: str) -> str:
    """Return ``name`` if it is one of :data:`TRANSFORMS`, else raise a ``ValueError`` listing the choices."""
    if name not in TRANSFORMS:
        raise ValueError(
            f"unknown transform {name!r}; choose one of {', '.join(repr(t) for t in TRANSFORMS)}"
        )
    return name


def preprocess(
    images: torch.Tensor,
    transform: str = "logit",
    alpha: float = DEFAULT_ALPHA,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Map uint8 images to model space (same shape, float32) by one of the pipelines of :data:`TRANSFORMS`."""
    check_transform(transform)
    if transform == "pixels":
        return images.to(torch.float32) / 255.0
    if transform == "unit":
        return dequantize(images, generator, alpha)
    if alpha <= 0.0:
        raise ValueError(
            f"transform {transform!r} needs alpha > 0 (logit of 0 or 1 is infinite), got {alpha}"
        )
    if transform == "logit":
        return logit_transform(dequantize(images, generator, alpha), alpha)
    return logit_transform(dequantize_squeeze(images, generator, alpha), alpha)


def to_unit(x: torch.Tensor, transform: str = "logit", alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """Inverse of :func:`preprocess` up to the noise: model-space values to intensities in ``[0, 1]`` (clamped, as
    model samples may leave the data's range; ``"pixels"`` and ``"unit"`` values are only clamped)."""
    check_transform(transform)
    if transform in _NO_LOGIT:
        out = x
    elif transform == "logit":
        out = inverse_logit(x)
    else:
        out = inverse_squeeze(inverse_logit(x), alpha)
    return out.clamp(0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class ImageCodec:
    """The map between model space and 8-bit images of one pre-processing pipeline (``transform`` of
    :data:`TRANSFORMS`, its ``alpha``, one image's shape), validated on construction. Plain values only
    (:meth:`as_dict`), so a model keeps it in its checkpoint and decodes samples or reports bits/dim without the
    data module.

    >>> codec = ImageCodec("logit_squeeze", 1e-3, (1, 2, 2))
    >>> images = torch.tensor([[[[0, 64], [128, 255]]]], dtype=torch.uint8)
    >>> x = preprocess(images.reshape(1, -1), codec.transform, codec.alpha)
    >>> bool((codec.to_images(x) * 256 - images).abs().max() <= 1.0), codec.exact_bits_per_dim
    (True, True)
    >>> ImageCodec.from_dict(codec.as_dict()) == codec
    True
    """

    transform: str
    alpha: float
    image_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        check_transform(self.transform)
        # the logit of 0 or 1 is infinite, so only the transforms without a logit accept alpha = 0
        lowest_ok = self.alpha >= 0.0 if self.transform in _NO_LOGIT else self.alpha > 0.0
        if not (lowest_ok and self.alpha < 0.5):
            interval = "[0, 0.5)" if self.transform in _NO_LOGIT else "(0, 0.5)"
            raise ValueError(f"alpha must lie in {interval} for transform {self.transform!r}, got {self.alpha}")
        shape = tuple(int(s) for s in self.image_shape)
        if not shape or min(shape) < 1:
            raise ValueError(f"image_shape must be a non-empty tuple of positive sizes, got {self.image_shape}")
        # normalised so that equality and as_dict() do not depend on how the fields were passed
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "image_shape", shape)

    @property
    def dim(self) -> int:
        """Number of model-space dimensions of one image."""
        return math.prod(self.image_shape)

    @property
    def exact_bits_per_dim(self) -> bool:
        """Whether :meth:`bits_per_dim` is exact: only for the invertible ``"logit_squeeze"``."""
        return self.transform == "logit_squeeze"

    def to_images(self, x: torch.Tensor) -> torch.Tensor:
        """Model-space samples ``[B, ...]`` to images ``[B, *image_shape]`` in ``[0, 1]`` (:func:`to_unit`): a pixel
        ``k`` comes back inside its bin for ``"logit_squeeze"``, within ``1/512`` of ``k/255`` for the clamp
        pipelines, exactly ``k/255`` for ``"pixels"``."""
        if x.dim() < 1 or math.prod(x.shape[1:]) != self.dim:
            raise ValueError(
                f"expected a batch [B, ...] of {self.dim} values per sample (images {self.image_shape}), "
                f"got shape {tuple(x.shape)}"
            )
        c, h, w = self.image_shape
        flat = to_unit(x, self.transform, self.alpha).reshape(x.shape[0], -1)
        return rearrange(flat, "b (c h w) -> b c h w", c=c, h=h, w=w)

    def bits_per_dim(self, log_prob: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Pixel-space bits/dim ``[B]`` (float64) of model-space samples ``x`` of log-density ``log_prob`` (for
        ``"unit"`` already a density on ``[0, 1]^D``); ``"pixels"`` raises ``ValueError`` (discrete data)."""
        if self.transform == "pixels":
            raise ValueError("transform 'pixels' keeps the 256 pixel values discrete: a density has no bits/dim "
                             "there; use 'logit_squeeze' (exact) for likelihoods")
        log_prob = log_prob.double()
        if self.transform == "unit":
            dims = x[0].numel()
            return -(log_prob - dims * math.log(256)) / (dims * math.log(2.0))
        alpha = self.alpha if self.transform == "logit_squeeze" else 0.0
        return bits_per_dim(log_prob, inverse_logit(x.double()), alpha=alpha)

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain Python values (``image_shape`` as a list), e.g. for a checkpoint or YAML."""
        return {"transform": self.transform, "alpha": self.alpha, "image_shape": list(self.image_shape)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ImageCodec:
        """Inverse of :meth:`as_dict`; raises ``ValueError`` on missing or unknown keys or invalid values."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = sorted(names - d.keys()), sorted(d.keys() - names)
        if missing or unknown:
            raise ValueError(
                f"an ImageCodec dict needs exactly the keys {sorted(names)}; missing {missing}, unknown {unknown}"
            )
        return cls(transform=d["transform"], alpha=float(d["alpha"]), image_shape=tuple(d["image_shape"]))
