"""Dataset pieces shared by every image DataModule: the train/val split, in-memory and pre-processed datasets
and the per-epoch shuffle sampler.

Noise and order are functions of seeds only (never of global random state), so a resumed run, any number of
DataLoader workers and any process see exactly the same data.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from deqscore.data.transforms import DEFAULT_ALPHA, check_transform, preprocess
from deqscore.privates import IndexSamplerLoader, loader_index_sampler

__all__ = ["ArrayImageDataset", "EpochShuffleSampler", "PreprocessedImageDataset", "split_indices"]

# Seed offsets of the dequantisation noise: seed = offset + index into the base (train or test) set, so every
# item has its own draw and the three splits never share one.
VAL_NOISE_SEED = 1_000_000
TEST_NOISE_SEED = 2_000_000
TRAIN_NOISE_SEED = 3_000_000  # + epoch * EPOCH_STRIDE + index
EPOCH_STRIDE = 10_000_000


def split_indices(n: int, val_fraction: float = 0.1, seed: int = 2019) -> tuple[np.ndarray, np.ndarray]:
    """Train/val split of ``range(n)`` as the reference code's ``np.random.seed(seed); np.random.shuffle(indices)``
    (a private ``RandomState``): the first ``int(n * (1 - val_fraction))`` shuffled indices train."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    indices = np.arange(n)
    np.random.RandomState(seed).shuffle(indices)
    n_train = int(n * (1.0 - val_fraction))
    return indices[:n_train], indices[n_train:]


class ArrayImageDataset(Dataset):
    """In-memory ``(uint8 image tensor, int label)`` dataset over numpy arrays."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = torch.from_numpy(np.ascontiguousarray(images))
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


class PreprocessedImageDataset(Dataset):
    """Items ``(x float32 [D], label)`` of ``base[indices[i]]`` (uint8 images) after dequantisation and ``transform``.

    The noise is fresh on every read with ``noise_seed`` None, else drawn from a generator seeded with
    ``noise_seed + base_index``, plus ``epoch * 10^7`` with ``per_epoch`` (:meth:`set_epoch`): fresh every epoch,
    the same across resumes and workers. With ``flip_shape`` ``(C, H, W)`` an item is flipped horizontally with
    probability 1/2, the coin drawn from the item's generator after its noise.
    """

    def __init__(
        self,
        base: Dataset,
        indices: np.ndarray,
        transform: str = "logit",
        alpha: float = DEFAULT_ALPHA,
        noise_seed: int | None = None,
        per_epoch: bool = False,
        flip_shape: tuple[int, ...] | None = None,
    ) -> None:
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.transform = check_transform(transform)
        self.alpha = alpha
        self.noise_seed = noise_seed
        self.per_epoch = per_epoch
        self.flip_shape = tuple(flip_shape) if flip_shape is not None else None
        # shared memory, so persistent DataLoader workers see the epoch the main process sets
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        base_index = int(self.indices[index])
        image, label = self.base[base_index]
        generator = None
        if self.noise_seed is not None:
            epoch_offset = int(self._epoch) * EPOCH_STRIDE if self.per_epoch else 0
            generator = torch.Generator().manual_seed(self.noise_seed + epoch_offset + base_index)
        x = preprocess(image.reshape(-1), self.transform, self.alpha, generator)
        if self.flip_shape is not None and bool(torch.rand((), generator=generator) < 0.5):
            x = x.view(self.flip_shape).flip(-1).reshape(-1)
        return x, int(label)


class EpochShuffleSampler(torch.utils.data.Sampler[int]):
    """Random permutation of ``range(n)`` drawn from ``seed + epoch``: reproducible per epoch, so resuming
    mid-training repeats the order an uninterrupted run would use. Lightning calls :meth:`set_epoch` (under DDP
    through the sampler that shards it)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())

    def __len__(self) -> int:
        return self.n


class ResumableLoader(IndexSamplerLoader):
    """The training DataLoader, resumable within an epoch: its state (the epoch and the batches it has yielded in
    it) is saved with every checkpoint (Lightning's stateful-loader protocol), and a loader restored from one skips
    those batches of the epoch, so a run resumed from a checkpoint saved between two batches trains on exactly the
    batches an uninterrupted run would (Lightning does not prefetch from a loader with a length, and counts the
    epoch's batches done on a restart, so its length stays the epoch's)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0  # batches of the current epoch, those skipped at a resume included
        self.pending_skip: int | None = None  # batches the next pass leaves out (taken by its index sampler)
        self._skipping = _SkipFirst(self)

    def index_sampler(self) -> _SkipFirst:
        # The batches are skipped where their indices are drawn, whatever sampler Lightning put in place (under DDP
        # a sharding wrapper of the epoch sampler), so no skipped batch is loaded.
        return self._skipping

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "batches": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["batches"] >= super().__len__():  # saved at the epoch's last batch: the next epoch starts afresh
            return
        self.sampler.set_epoch(state["epoch"])
        self.pending_skip = state["batches"]

    def __iter__(self):
        skip = self.pending_skip or 0
        iterator = super().__iter__()
        self._yielded = skip
        for batch in iterator:
            self._yielded += 1
            yield batch


class _SkipFirst:
    """A :class:`ResumableLoader`'s index sampler (its batch sampler, or its sampler without batching) that leaves
    out the loader's pending skip of the next pass. Its length stays the epoch's: Lightning counts a resumed
    epoch's batches done."""

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader

    def _epoch(self):
        return loader_index_sampler(self.loader)  # what the loader would draw its pass from

    def __len__(self) -> int:
        return len(self._epoch())

    def __iter__(self):
        # a generator: the skip is taken when the first index is drawn, not when a data-loader iterator is set up
        # (a worker-based iterator sets up one pass it never draws from before the one it uses)
        skip, self.loader.pending_skip = self.loader.pending_skip or 0, None
        yield from itertools.islice(self._epoch(), skip, None)


def epoch_loader(
    dataset: Dataset, batch_size: int, train: bool, seed: int, num_workers: int = 0, pin_memory: bool = False,
    drop_last: bool | None = None,
) -> DataLoader:
    """A DataLoader of ``dataset``: training batches in an :class:`EpochShuffleSampler` order seeded by ``seed``
    (``drop_last`` defaults to ``train``), evaluation batches in order."""
    return (ResumableLoader if train else DataLoader)(
        dataset,
        batch_size=batch_size,
        sampler=EpochShuffleSampler(len(dataset), seed) if train else None,
        drop_last=train if drop_last is None else drop_last,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
    )
