"""Small stand-ins for CIFAR-10 and CelebA in their exact on-disk formats (random pixels, real file formats)."""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path

import numpy as np

CELEBA_SIZE = (178, 218)  # width, height of the aligned CelebA images


def cifar_arrays(n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8), rng.integers(0, 10, size=n).tolist()


def write_cifar10(root: Path, per_batch: int = 6, n_test: int = 8, archive: bool = False) -> Path:
    """CIFAR-10's five train batches and test batch as pickles under ``root/cifar-10-batches-py`` (or only the
    ``.tar.gz`` of that folder in ``root`` with ``archive``); returns ``root``."""
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    files = [(f"data_batch_{i}", per_batch, i) for i in range(1, 6)] + [("test_batch", n_test, 0)]
    for name, n, seed in files:
        data, labels = cifar_arrays(n, seed)
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, fh)
    if archive:
        with tarfile.open(Path(root) / "cifar-10-python.tar.gz", "w:gz") as tar:
            tar.add(folder, arcname=folder.name)
        for name, _, _ in files:
            (folder / name).unlink()
        folder.rmdir()
    return Path(root)


def write_celeba(root: Path, partitions: tuple[int, ...] = (0,) * 10 + (1,) * 2 + (2,) * 4) -> Path:
    """``root/celeba/img_align_celeba/*.jpg`` (random 178x218 JPEGs) and ``list_eval_partition.txt``."""
    from PIL import Image

    folder = Path(root) / "celeba"
    (folder / "img_align_celeba").mkdir(parents=True, exist_ok=True)
    rng, lines = np.random.default_rng(0), []
    for i, part in enumerate(partitions, 1):
        name = f"{i:06d}.jpg"
        pixels = rng.integers(0, 256, size=(CELEBA_SIZE[1], CELEBA_SIZE[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / "img_align_celeba" / name, quality=95)
        lines.append(f"{name} {part}")
    (folder / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")
    return Path(root)
