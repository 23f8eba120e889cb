"""Pre-processing of 8-bit images for density models (METHOD.md §4.1) and the bits/dim conversion.

Two pre-processing pipelines are provided; ``k`` is the uint8 pixel value and ``U ~ U(0, 1)``:

* **REF (clamp)**, used for training as in the reference code::

      x = k/255 + (U - 0.5)/256,   x <- clamp(x, alpha, 1 - alpha),   y = logit(x)

  (:func:`dequantize` then :func:`logit_transform`). The clamp is not invertible, so a pixel-space
  likelihood computed from it is only approximate.
* **Invertible squeeze** (METHOD.md §4.1, "Evaluation"; the standard, comparable bits/dim)::

      x~ = (k + U)/256,   x' = alpha + (1 - 2 alpha) x~,   y = logit(x')

  (:func:`dequantize_squeeze` then :func:`logit_transform`); :func:`bits_per_dim` with the same ``alpha``
  accounts for the squeeze's Jacobian.

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

import math

import torch

__all__ = [
    "DEFAULT_ALPHA",
    "TRANSFORMS",
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
#: ``"logit_squeeze"`` (invertible squeeze + logit, for exact pixel-space bits/dim).
TRANSFORMS: tuple[str, ...] = ("logit", "unit", "logit_squeeze")


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
    """Dequantise 8-bit images as the reference code does (METHOD.md §4.1).

    ``x = k/255 + (U - 0.5)/256`` with ``U ~ U(0, 1)`` i.i.d. per pixel, then clamped to
    ``[alpha, 1 - alpha]``. The noise is bounded by ``1/512`` in absolute value (the clamp only moves values
    towards the pixel).

    Args:
        images: uint8 (or integer-valued) tensor of any shape with values in ``0..255``.
        generator: optional random generator for reproducible noise (e.g. for evaluation).
        alpha: clamp margin; ``0`` disables clamping away from the borders.
        dtype: floating dtype of the result.

    Returns:
        A float tensor of the same shape with values in ``[alpha, 1 - alpha]``.
    """
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
    """Invertible dequantisation: ``x' = alpha + (1 - 2 alpha) (k + U)/256`` (METHOD.md §4.1, evaluation).

    ``x~ = (k + U)/256`` partitions ``[0, 1)`` into the 256 pixel bins; the affine squeeze keeps ``x'`` inside
    ``[alpha, 1 - alpha]`` without clamping, so the map is invertible (:func:`inverse_squeeze`).

    Args:
        images: uint8 (or integer-valued) tensor with values in ``0..255``.
        generator: optional random generator for reproducible noise.
        alpha: squeeze margin in ``[0, 0.5)``.
        dtype: floating dtype of the result.

    Returns:
        A float tensor of the same shape with values in ``[alpha, 1 - alpha]``.
    """
    _check_alpha(alpha)
    x_tilde = (images.to(dtype) + _uniform_like(images, generator, dtype)) / 256.0
    return alpha + (1.0 - 2.0 * alpha) * x_tilde


def inverse_squeeze(x: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """Undo the squeeze of :func:`dequantize_squeeze`: ``x~ = (x' - alpha) / (1 - 2 alpha)``."""
    _check_alpha(alpha)
    return (x - alpha) / (1.0 - 2.0 * alpha)


def logit_transform(x: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """``y = logit(x) = log x - log(1 - x)`` after clamping ``x`` to ``[alpha, 1 - alpha]``.

    Values already inside the interval (the output of :func:`dequantize` or :func:`dequantize_squeeze` with
    the same ``alpha``) are not changed by the clamp.
    """
    _check_alpha(alpha)
    x = x.clamp(alpha, 1.0 - alpha)
    return torch.log(x) - torch.log1p(-x)


def inverse_logit(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`logit_transform` (the logistic sigmoid), mapping logit space back to ``(0, 1)``."""
    return torch.sigmoid(y)


def logit_log_det(x: torch.Tensor) -> torch.Tensor:
    """Per-sample log-determinant of the Jacobian of ``y = logit(x)``.

    ``dy/dx = 1/(x (1 - x))``, so ``log|det J| = sum_d [-log x_d - log(1 - x_d)]``, summed over every
    dimension but the first (batch) one.

    Args:
        x: tensor ``[B, ...]`` with values in ``(0, 1)``.

    Returns:
        Tensor ``[B]``.
    """
    per_dim = -torch.log(x) - torch.log1p(-x)
    return per_dim.reshape(x.shape[0], -1).sum(dim=1)


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

    Args:
        log_prob_logit_space: ``[B]`` log-density ``log p(y)`` in nats.
        x_unit: ``[B, ...]`` the values in ``(0, 1)`` whose logit was fed to the model (``sigmoid(y)``).
        n_bins: number of pixel levels (256 for 8-bit data).
        alpha: squeeze margin used in pre-processing (0 for none).

    Returns:
        Tensor ``[B]`` of bits per dimension.
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
    """Map uint8 images to model space (same shape, float32).

    * ``"logit"``: ``logit(clamp(k/255 + (U - 0.5)/256, alpha, 1 - alpha))`` (reference pipeline),
    * ``"unit"``: ``clamp(k/255 + (U - 0.5)/256, alpha, 1 - alpha)``,
    * ``"logit_squeeze"``: ``logit(alpha + (1 - 2 alpha)(k + U)/256)`` (invertible).
    """
    check_transform(transform)
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
    """Inverse of :func:`preprocess` up to the noise: model-space values to intensities in ``[0, 1]``."""
    check_transform(transform)
    if transform == "unit":
        out = x
    elif transform == "logit":
        out = inverse_logit(x)
    else:
        out = inverse_squeeze(inverse_logit(x), alpha)
    return out.clamp(0.0, 1.0)
