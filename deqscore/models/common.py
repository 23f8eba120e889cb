"""Helpers that several model families share (shapes of image data)."""

from __future__ import annotations

import math

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
