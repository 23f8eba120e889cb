"""Sampling: annealed Langevin dynamics (:class:`AnnealedLangevin`), Langevin dynamics on one density
(:class:`Langevin`), PNG grids and point plots, and drawing samples from any
family's module in batches, in memory
(:func:`draw_samples`, for small ``n``) or streamed to an ``.npy`` file (:func:`stream_samples`, any ``n``).

>>> import torch, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "grid.png")
>>> save_image_grid(torch.rand(4, 1, 28, 28), path)
>>> os.path.getsize(path) > 0
True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from .grid import pyplot, save_image_grid
from .langevin import LANGEVIN_INITS, LANGEVIN_VARIANTS, AnnealedLangevin, Langevin
from .stream import (
    GRID_SIZE,
    NpyAppender,
    OutputError,
    SampleFiles,
    check_output_dir,
    output_paths,
    staged,
    stream_samples,
)

__all__ = [
    "LANGEVIN_INITS",
    "LANGEVIN_VARIANTS",
    "AnnealedLangevin",
    "Langevin",
    "GRID_SIZE",
    "NpyAppender",
    "OutputError",
    "SampleFiles",
    "check_output_dir",
    "draw_samples",
    "output_paths",
    "pyplot",
    "save_image_grid",
    "staged",
    "stream_samples",
]


def draw_samples(
    draw: Callable[[int], torch.Tensor], n: int, batch_size: int = 256, progress: bool = True
) -> torch.Tensor:
    """Call ``draw(k)`` (e.g. ``module.sample_images``) in batches until ``n`` samples are drawn, and return them
    all as one tensor: memory grows with ``n``; use :func:`stream_samples` to write any number to disk."""
    out, drawn = [], 0
    with tqdm(total=n, desc="sampling", disable=not progress, unit="img") as bar:
        while drawn < n:
            k = min(batch_size, n - drawn)
            out.append(draw(k).cpu())
            drawn += k
            bar.update(k)
    return torch.cat(out)
