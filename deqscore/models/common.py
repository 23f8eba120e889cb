"""Helpers that several model families share (shapes of image data)."""

from __future__ import annotations

import math

from torch import Tensor

from ..errors import ConfigError, check_count


def image_side(dim: int, channels: int, owner: str) -> int:
    """Side of the square ``channels``-channel image with ``dim`` values, or a ConfigError naming ``owner``'s
    options.

    >>> image_side(3 * 32 * 32, 3, "NCSN")
    32
    """
    check_count(f"{owner} channels", channels)
    side = math.isqrt(dim // channels) if dim % channels == 0 else 0
    if side < 1 or channels * side * side != dim:
        raise ConfigError(f"{owner} dim={dim} is not a square image of channels={channels}; set `channels` to the "
                          "data's (1 for MNIST, 3 for CIFAR-10 and CelebA)")
    return side


def as_images(x: Tensor, image_shape: tuple[int, int, int], owner: str) -> Tensor:
    """``x`` (``[B, dim]`` or ``[B, C, H, W]``) as images ``[B, *image_shape]``, or a ValueError naming ``owner``."""
    if x.dim() < 2 or x[0].numel() != math.prod(image_shape):
        raise ValueError(f"{owner} expects inputs [B, {math.prod(image_shape)}] or "
                         f"[B, {', '.join(map(str, image_shape))}], got {tuple(x.shape)}")
    return x.reshape(x.shape[0], *image_shape)
