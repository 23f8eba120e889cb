"""Sampling utilities: drawing samples from any family's module in batches and saving them.

>>> import torch, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "grid.png")
>>> save_image_grid(torch.rand(4, 1, 28, 28), path)
>>> os.path.getsize(path) > 0
True
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torchvision.utils import save_image
from tqdm.auto import tqdm


def save_image_grid(images: torch.Tensor, path: str | Path, nrow: int | None = None) -> None:
    """Save images in [0, 1] (``[N, C, H, W]``) as one PNG grid."""
    if images.dim() != 4:
        raise ValueError(f"expected images of shape [N, C, H, W], got {tuple(images.shape)}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    nrow = nrow or max(1, int(len(images) ** 0.5))
    save_image(images.float().clamp(0, 1).cpu(), str(path), nrow=nrow, padding=2)


def draw_samples(
    draw: Callable[[int], torch.Tensor], n: int, batch_size: int = 256, progress: bool = True
) -> torch.Tensor:
    """Call ``draw(k)`` (e.g. ``module.sample_images``) in batches until ``n`` samples are drawn."""
    out, drawn = [], 0
    with tqdm(total=n, desc="sampling", disable=not progress, unit="img") as bar:
        while drawn < n:
            k = min(batch_size, n - drawn)
            out.append(draw(k).cpu())
            drawn += k
            bar.update(k)
    return torch.cat(out)


def save_samples(samples: torch.Tensor, out_dir: str | Path, stem: str = "samples") -> tuple[Path, Path]:
    """Write ``<stem>.png`` (grid of at most 100) and ``<stem>.npz`` (all samples, key ``samples``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png, npz = out_dir / f"{stem}.png", out_dir / f"{stem}.npz"
    if samples.dim() == 4:
        save_image_grid(samples[:100], png)
    np.savez_compressed(npz, samples=samples.numpy())
    return png, npz
