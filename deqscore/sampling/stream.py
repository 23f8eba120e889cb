"""Streaming samples to disk: memory stays one batch (plus a preview of at most 100 images) whatever ``n``.

``stream_samples(draw, n, out_dir)`` calls ``draw(k)`` with ``k <= batch_size`` until ``n`` images are drawn and
writes

* ``<out_dir>/samples.npz``: every sample, the array ``samples`` ``[n, C, H, W]`` of the dtype ``draw`` returns
  (``float32`` for the modules' images in [0, 1]). Each batch is appended to the archive and flushed as soon as
  it is drawn; read it with ``np.load(path)["samples"]``.
* ``<out_dir>/samples.png``: a grid of the first ``min(n, 100)`` samples.

Both are written under temporary names (``.samples.partial.<pid>.npz`` and ``.png``) and renamed onto the final
names only once everything is written; an exception (Ctrl-C included) removes them, so a file under a final
name is always complete.

>>> import tempfile, numpy as np, torch
>>> out = tempfile.mkdtemp()
>>> files = stream_samples(lambda k: torch.full((k, 1, 2, 2), 0.5), 5, out, batch_size=2, progress=False)
>>> np.load(files.array)["samples"].shape, files.shape
((5, 1, 2, 2), (5, 1, 2, 2))
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from tqdm.auto import tqdm

from ..files import staged, unwritable
from .grid import save_image_grid

#: at most this many samples go into the PNG grid
GRID_SIZE = 100


class OutputError(ValueError):
    """The output location cannot hold the samples (reported before anything is drawn)."""


@dataclass(frozen=True)
class SampleFiles:
    """What :func:`stream_samples` wrote: the array file, the PNG grid and the array's shape."""

    array: Path
    grid: Path
    shape: tuple[int, ...]


def output_paths(out_dir: str | Path, stem: str = "samples") -> tuple[Path, Path]:
    """The final ``(<stem>.npz, <stem>.png)`` in ``out_dir``."""
    out_dir = Path(out_dir)
    return out_dir / f"{stem}.npz", out_dir / f"{stem}.png"


# ----- checking the output location before anything is drawn ---------------------------------------------------
def check_output_dir(out_dir: str | Path, stem: str = "samples") -> None:
    """Raise :class:`OutputError` unless ``out_dir`` is, or can be created as, a writable directory whose sample
    files can be replaced. Creates nothing (a probe file in the existing directory is removed at once)."""
    out_dir = Path(out_dir)
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        raise OutputError(f"{out_dir} exists and is not a directory")
    for path in output_paths(out_dir, stem):
        if path.is_dir():
            raise OutputError(f"{path} is a directory; the samples cannot be written over it")
    problem = unwritable(out_dir)
    if problem is not None:
        existing, reason = problem
        if reason == "not a directory":
            raise OutputError(f"cannot create {out_dir}: {existing} is not a directory")
        raise OutputError(f"cannot write in {existing}: {reason}")


# ----- writing -----------------------------------------------------------------------------------------------
class NpyAppender:
    """An ``.npy`` array of a shape known in advance, written and flushed batch by batch along the first axis, to an
    ``.npy`` file or, with ``member``, into an ``.npz`` archive (a zip64 of ``.npy`` files, stored uncompressed).
    :meth:`close` checks that exactly ``shape[0]`` rows were written."""

    def __init__(self, path: str | Path, shape: tuple[int, ...], dtype: np.dtype, member: str | None = None) -> None:
        self.path, self.shape, self.dtype = Path(path), tuple(int(s) for s in shape), np.dtype(dtype)
        if self.dtype.hasobject:
            raise ValueError(f"cannot stream an array of Python objects ({self.dtype}) to {self.path}")
        self.rows = 0
        self._raw: BinaryIO = open(self.path, "wb")  # closed by close() or __exit__
        self._zip = None if member is None else zipfile.ZipFile(self._raw, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._file = self._raw if self._zip is None else self._zip.open(f"{member}.npy", "w", force_zip64=True)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": self.shape}
        np.lib.format.write_array_header_1_0(self._file, header)

    def append(self, batch: np.ndarray) -> None:
        if batch.shape[1:] != self.shape[1:] or batch.dtype != self.dtype:
            raise ValueError(f"a batch of shape {batch.shape[1:]} and dtype {batch.dtype} does not fit an array "
                             f"of rows {self.shape[1:]} and dtype {self.dtype}")
        if self.rows + len(batch) > self.shape[0]:
            raise ValueError(f"{self.rows + len(batch)} rows exceed the {self.shape[0]} of {self.path}")
        self._file.write(np.ascontiguousarray(batch).data)
        self._raw.flush()
        self.rows += len(batch)

    def _close_files(self) -> None:
        try:
            if self._zip is not None:  # the member, then the archive's directory; the raw file last
                self._file.close()
                self._zip.close()
        finally:
            self._raw.close()

    def close(self) -> None:
        self._close_files()
        if self.rows != self.shape[0]:
            raise ValueError(f"{self.path} holds {self.rows} rows, its header promises {self.shape[0]}")

    def __enter__(self) -> NpyAppender:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
        else:  # the error that stopped the writing is the one to report, not the missing rows
            try:
                self._close_files()
            except OSError:  # e.g. a full disk: the partial file is removed by the caller anyway
                pass


class Preview:
    """A copy of the first ``size`` images seen, in one array (so the batches they came from can be freed)."""

    def __init__(self, size: int = GRID_SIZE) -> None:
        self.size, self.count = size, 0
        self.array: np.ndarray | None = None

    def add(self, batch: np.ndarray) -> None:
        if self.array is None:
            self.array = np.empty((self.size, *batch.shape[1:]), batch.dtype)
        take = min(len(batch), self.size - self.count)
        self.array[self.count : self.count + take] = batch[:take]
        self.count += take

    def images(self) -> torch.Tensor:
        if self.array is None:
            raise ValueError("no images seen")
        return torch.from_numpy(self.array[: self.count])


# ----- drawing -----------------------------------------------------------------------------------------------
def _draw(draw: Callable[[int], torch.Tensor], k: int) -> np.ndarray:
    """``draw(k)`` on the CPU as a NumPy array, checked to hold ``k`` samples."""
    batch = draw(k).detach().cpu().numpy()
    if batch.ndim < 1 or len(batch) != k:
        raise ValueError(f"draw({k}) returned an array of shape {batch.shape}, expected {k} samples")
    return batch


def _batch_sizes(n: int, batch_size: int) -> Iterator[int]:
    for start in range(0, n, batch_size):
        yield min(batch_size, n - start)


def stream_samples(
    draw: Callable[[int], torch.Tensor],
    n: int,
    out_dir: str | Path,
    batch_size: int = 256,
    stem: str = "samples",
    progress: bool = True,
    picture: Callable[[np.ndarray, Path], object] | None = None,
    picture_size: int = GRID_SIZE,
) -> SampleFiles:
    """Call ``draw(k)`` (``k <= batch_size``, e.g. ``module.sample_images``) until ``n`` images ``[k, C, H, W]`` are
    drawn, appending each batch to the array ``<stem>`` of ``<stem>.npz`` and keeping the first 100 for
    ``<stem>.png`` (module doc). Samples that are not images (``module.sample_points``) give ``picture``, called
    with the first ``picture_size`` samples and the PNG's path, in place of the grid.

    The first batch is drawn before anything is created, so a ``draw`` that fails at once leaves nothing behind.
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
    array_path, grid_path = output_paths(out_dir, stem)
    sizes = _batch_sizes(n, batch_size)
    batch = _draw(draw, next(sizes))  # before anything is shown or created: a failing draw leaves nothing
    shape = (n, *batch.shape[1:])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with tqdm(total=n, desc="sampling", unit="img", disable=not progress) as bar, \
            staged([array_path, grid_path]) as (array_tmp, grid_tmp):
        preview = Preview(picture_size if picture is not None else GRID_SIZE)
        with NpyAppender(array_tmp, shape, batch.dtype, member=stem) as writer:
            while batch is not None:
                writer.append(batch)
                preview.add(batch)
                bar.update(len(batch))
                batch = None  # free the written batch before drawing the next one
                k = next(sizes, None)
                batch = _draw(draw, k) if k else None
        if picture is None:
            save_image_grid(preview.images(), grid_tmp)
        else:
            picture(preview.images().numpy(), grid_tmp)
    return SampleFiles(array_path, grid_path, shape)
