"""PNG grids of images in [0, 1].

>>> import torch, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "grid.png")
>>> save_image_grid(torch.rand(4, 1, 28, 28), path)
>>> os.path.getsize(path) > 0
True
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.utils import save_image


def save_image_grid(images: torch.Tensor, path: str | Path, nrow: int | None = None) -> None:
    """Save images in [0, 1] (``[N, C, H, W]``) as one PNG grid (PNG whatever the file name's suffix)."""
    if images.dim() != 4:
        raise ValueError(f"expected images of shape [N, C, H, W], got {tuple(images.shape)}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    nrow = nrow or max(1, int(len(images) ** 0.5))
    save_image(images.float().clamp(0, 1).cpu(), str(path), nrow=nrow, padding=2, format="PNG")


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display needed): every figure deqscore writes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
