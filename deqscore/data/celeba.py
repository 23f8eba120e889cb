"""``CelebADataModule``: CelebA faces at 64x64 (NCSNv2's pre-processing), in torchvision's on-disk layout.

Files: ``<data_dir>/celeba/img_align_celeba/*.jpg`` (the 178x218 aligned faces, ``img_align_celeba.zip``
extracted) and ``<data_dir>/celeba/list_eval_partition.txt`` (lines ``000001.jpg 0``: 0 train, 1 valid, 2 test).
The train split is partition 0 (162,770 images; the base class then holds out ``val_fraction`` of it for
validation), the test split partition 2 (19,962); partition 1 (the official validation set) is not used, as in
NCSNv2, which trains on ``split="train"`` and tests on ``split="test"``.

Pre-processing, as NCSNv2's ``CenterCrop(140)`` then ``Resize(64)`` on PIL images: a centre crop of 140x140 (with
torchvision's offsets, ``round((218 - 140) / 2) = 39`` from the top, 19 from the left) resized to 64x64 by PIL's
bilinear filter, which is antialiased when shrinking (its support widens with the scale), then stored as uint8.

Decoding 200k JPEGs takes minutes, so each split is decoded once (with a progress bar) into
``<data_dir>/celeba/celeba64_{train,test}.npy`` (uint8 ``[N, 3, 64, 64]``, written atomically; about 2 GB for the
train split) and later memory-mapped; once both exist the JPEGs are no longer read. A cache is used when its
shape matches the partition file; after replacing images, delete it. ``use_lmdb: true`` is recommended: the
framework's LMDB cache checksums every item and is what DataLoader workers read.

:meth:`prepare_data` downloads through ``torchvision.datasets.CelebA(split="all")`` (Google Drive, often
rate-limited) as a last resort, never :meth:`setup`; offline the error names the files and where to put them. A
listed image that is missing raises :class:`~deqscore.data.errors.DataNotFoundError`, one that does not decode
:class:`~deqscore.data.errors.CorruptDataError`, both naming it.

Config::

    data:
      class_path: deqscore.data.CelebADataModule
      init_args: {data_dir: datasets, batch_size: 128, transform: pixels, random_flip: true, use_lmdb: true}
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from deqscore.data.base import ImageDataModule
from deqscore.data.errors import CorruptDataError, DataNotFoundError
from deqscore.files import staged

__all__ = ["CelebADataModule", "crop_resize", "load_celeba64", "read_partition"]

FOLDER = "celeba"
IMAGES = "img_align_celeba"
PARTITION = "list_eval_partition.txt"
CROP, SIZE = 140, 64
SPLITS = {True: 0, False: 2}  # train -> partition 0, test -> partition 2 (partition 1 unused)
_SHOWN = 5  # missing files named in an error


def read_partition(path: Path, train: bool) -> list[str]:
    """The image file names of the train (partition 0) or test (partition 2) split, in the file's order."""
    wanted, names = SPLITS[train], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or fields[1] not in ("0", "1", "2"):
            raise CorruptDataError(f"{path}, line {number}: expected '<file>.jpg <0|1|2>', got {line!r}")
        if int(fields[1]) == wanted:
            names.append(fields[0])
    if not names:
        raise CorruptDataError(f"{path} lists no image of partition {wanted}")
    return names


def crop_resize(path: Path) -> np.ndarray:
    """One image: centre crop 140x140, resize to 64x64 (PIL bilinear, antialiased), as uint8 ``[3, 64, 64]``."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image = image.convert("RGB")  # decodes the whole file, so a truncated one fails here
            w, h = image.size
            left, top = round((w - CROP) / 2), round((h - CROP) / 2)  # torchvision's CenterCrop offsets
            image = image.crop((left, top, left + CROP, top + CROP)).resize((SIZE, SIZE), Image.BILINEAR)
            return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
    except (OSError, ValueError, SyntaxError) as err:  # PIL's errors for unknown, truncated or damaged files
        raise CorruptDataError(f"{path} is not a readable image ({type(err).__name__}: {err})") from err


def _check_images(folder: Path, names: list[str]) -> None:
    """Every listed image is there (checked before minutes of decoding, not after)."""
    present = set(os.listdir(folder))
    missing = [n for n in names if n not in present]
    if missing:
        shown = ", ".join(missing[:_SHOWN]) + (f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else "")
        raise DataNotFoundError(f"{len(missing)} CelebA image(s) listed in {PARTITION} are not in {folder}: {shown}")


def _save_atomically(cache: Path, images: np.ndarray) -> None:
    try:
        with staged([cache]) as (tmp,):
            np.save(tmp, images)
    except OSError as err:  # a read-only data folder: decode again next time
        warnings.warn(f"cannot cache the decoded CelebA images as {cache}: {err}", RuntimeWarning, stacklevel=3)


def _decode(folder: Path, names: list[str], cache: Path) -> np.ndarray:
    _check_images(folder / IMAGES, names)
    images = np.empty((len(names), 3, SIZE, SIZE), dtype=np.uint8)
    for i, name in enumerate(tqdm(names, desc=f"decoding CelebA into {cache.name}", unit="img", leave=False)):
        images[i] = crop_resize(folder / IMAGES / name)
    _save_atomically(cache, images)
    return images


def _cached(cache: Path, n: int) -> np.ndarray | None:
    """The decoded split if ``cache`` holds ``n`` images of the right shape, else None."""
    if not cache.is_file():
        return None
    try:
        # copy-on-write map: pages load on demand and are shared by forked workers; writable, as torch wants
        images = np.load(cache, mmap_mode="c")
    except (OSError, ValueError) as err:
        warnings.warn(f"decoding CelebA again: the cache {cache} is unreadable ({err})", RuntimeWarning, stacklevel=3)
        return None
    return images if images.shape == (n, 3, SIZE, SIZE) and images.dtype == np.uint8 else None


def _download(root: Path) -> str:
    """Fetch and extract CelebA through torchvision; returns why it failed ('' when it did not)."""
    from torchvision.datasets import CelebA

    try:
        CelebA(str(root), split="all", download=True)
    except Exception as err:  # offline, Google Drive's quota, a full disk: reported in the one error below
        return f"{type(err).__name__}: {err}"
    return ""


def _not_found(folder: Path, failure: str) -> DataNotFoundError:
    tried = f" (its download failed: {failure})" if failure else ""
    return DataNotFoundError(
        f"CelebA is not in {folder.resolve()}{tried}: put {PARTITION} there and the aligned images "
        f"(img_align_celeba.zip, extracted) in {(folder / IMAGES).resolve()}/, both from the CelebA site or its "
        "Google Drive"
    )


def load_celeba64(root: str | Path, train: bool, download: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """CelebA's train or test split at 64x64 as ``(uint8 [N, 3, 64, 64], zero labels [N])`` (see the module
    docstring): from the ``.npy`` cache, else decoded from the JPEGs, which ``download`` fetches if absent."""
    folder = Path(root) / FOLDER
    cache = folder / f"celeba{SIZE}_{'train' if train else 'test'}.npy"
    failure = ""
    if download and not ((folder / PARTITION).is_file() and ((folder / IMAGES).is_dir() or cache.is_file())):
        failure = _download(Path(root))
    if not (folder / PARTITION).is_file():
        raise _not_found(folder, failure)
    names = read_partition(folder / PARTITION, train)
    images = _cached(cache, len(names))
    if images is None:
        if not (folder / IMAGES).is_dir():
            raise _not_found(folder, failure)
        images = _decode(folder, names, cache)
    return np.asarray(images), np.zeros(len(names), dtype=np.int64)


class CelebADataModule(ImageDataModule):
    """CelebA at 64x64 as flattened 12288-d vectors (channel-major RGB), labels all 0.

    The options are those of :class:`~deqscore.data.base.ImageDataModule`: use ``transform: pixels`` and
    ``random_flip: true`` as NCSNv2, and ``use_lmdb: true`` (see the module docstring).
    """

    name = "celeba"
    image_shape = (3, SIZE, SIZE)
    num_classes = 1

    def load_arrays(self, train: bool, *, download: bool) -> tuple[np.ndarray, np.ndarray]:
        """Partition 0 (``train=True``) or 2 of ``list_eval_partition.txt``, see :func:`load_celeba64`."""
        return load_celeba64(self.data_dir, train, download=download)
