"""Plots of samples that are points, not images: a density plot of 2-D samples, a pairwise scatter plot of a few
dimension pairs for more dimensions, a histogram for one; each against held-out data where given.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "points.png")
>>> rng = np.random.RandomState(0)
>>> save_point_plot(rng.standard_normal((300, 5)), path, held_out=rng.standard_normal((100, 5)))
'a pairwise scatter plot of dimensions (1, 2), (3, 4), (5, 1) against 100 held-out points'
>>> os.path.getsize(path) > 0
True
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .grid import pyplot

#: at most this many dimension pairs in a pairwise scatter plot
MAX_PAIRS = 4


def dimension_pairs(dim: int, max_pairs: int = MAX_PAIRS) -> list[tuple[int, int]]:
    """Disjoint consecutive pairs ``(0, 1), (2, 3), ...`` (the last odd dimension paired with the first), at most
    ``max_pairs``: every dimension shown once where they fit."""
    pairs = [(i, (i + 1) % dim) for i in range(0, dim, 2)]
    return pairs[:max_pairs]


def save_point_plot(samples: np.ndarray, path: str | Path, held_out: np.ndarray | None = None,
                    columns: Sequence[str] = ()) -> str:
    """Plot ``samples [N, D]`` (and ``held_out [M, D]``) to the PNG ``path``; returns what was drawn, in words.
    D = 2: the samples' density (a 2-D histogram) with the held-out points over it; D > 2: scatter plots of
    :func:`dimension_pairs`; D = 1: histograms."""
    samples = np.asarray(samples, dtype=np.float64).reshape(len(samples), -1)
    dim = samples.shape[1]
    if held_out is not None and np.asarray(held_out).reshape(len(held_out), -1).shape[1] != dim:
        raise ValueError(f"held-out points of shape {np.shape(held_out)} do not match samples of dimension {dim}")
    names = list(columns) if len(columns) == dim else [f"x{i + 1}" for i in range(dim)]
    plt = pyplot()
    against = "" if held_out is None else f" against {len(held_out)} held-out points"
    if dim <= 2:
        fig, ax = plt.subplots(figsize=(5, 4.5))
        _one_panel(ax, samples, held_out, dim)
        ax.set_xlabel(names[0])
        if dim == 2:
            ax.set_ylabel(names[1])
        what = ("a density plot" if dim == 2 else "a histogram") + against
    else:
        pairs = dimension_pairs(dim)
        fig, axes = plt.subplots(1, len(pairs), figsize=(4 * len(pairs), 4), squeeze=False)
        for ax, (i, j) in zip(axes[0], pairs, strict=True):
            ax.scatter(samples[:, i], samples[:, j], s=4, alpha=0.4, color="tab:blue", label="samples")
            if held_out is not None:  # over the samples: the fewer points stay visible
                ax.scatter(held_out[:, i], held_out[:, j], s=6, alpha=0.8, color="tab:orange", label="held-out")
            ax.set_xlabel(names[i])
            ax.set_ylabel(names[j])
        axes[0][0].legend(loc="best", markerscale=3)
        what = f"a pairwise scatter plot of dimensions {', '.join(f'({i + 1}, {j + 1})' for i, j in pairs)}{against}"
    fig.suptitle(f"{len(samples)} samples")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return what


def _one_panel(ax, samples: np.ndarray, held_out: np.ndarray | None, dim: int) -> None:  # noqa: ANN001
    if dim == 1:
        bins = np.histogram_bin_edges(samples[:, 0], bins="auto")
        ax.hist(samples[:, 0], bins=bins, density=True, alpha=0.6, label="samples")
        if held_out is not None:
            ax.hist(np.asarray(held_out).reshape(-1), bins=bins, density=True, alpha=0.6, label="held-out")
        ax.legend(loc="best")
        return
    counts, xe, ye = np.histogram2d(samples[:, 0], samples[:, 1], bins=40, density=True)
    ax.imshow(counts.T, origin="lower", extent=(xe[0], xe[-1], ye[0], ye[-1]), aspect="auto", cmap="Blues")
    if held_out is not None:
        ax.scatter(held_out[:, 0], held_out[:, 1], s=3, color="tab:orange", alpha=0.6, label="held-out")
        ax.legend(loc="best", markerscale=3)


__all__ = ["MAX_PAIRS", "dimension_pairs", "save_point_plot"]
