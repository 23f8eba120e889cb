"""``CelebADataModule``: CelebA faces at 64x64 (NCSNv2's pre-processing), in torchvision's on-disk layout.

Files: ``<data_dir>/celeba/img_align_celeba/*.jpg`` (178x218 aligned faces) and
``<data_dir>/celeba/list_eval_partition.txt`` (lines ``000001.jpg 0``: 0 train, 1 valid, 2 test). The train split is
partition 0 (the base class then holds out ``val_fraction`` of it for validation), the test split partition 2;
partition 1 is not used. Each image is centre-cropped to 140x140 and resized to 64x64 with PIL's bilinear filter
(antialiased when shrinking), as NCSNv2 does through torchvision. Decoding 200k JPEGs takes minutes, so each split is
decoded once into ``<data_dir>/celeba/celeba64_{train,test}.npy`` (uint8, written atomically; about 2 GB for the
train split), and ``use_lmdb: true`` keeps it in the framework's LMDB cache besides.

:meth:`prepare_data` downloads through ``torchvision.datasets.CelebA`` (Google Drive, often rate-limited) as a last
resort; offline the error names the files and where to put them. An image that does not decode raises
:class:`~deqscore.data.errors.CorruptDataError` naming it.

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

FOLDER = "celeba"
IMAGES = "img_align_celeba"
PARTITION = "list_eval_partition.txt"
CROP, SIZE = 140, 64
SPLITS = {True: 0, False: 2}  # train -> partition 0, test -> partition 2


def read_partition(path: Path, train: bool) -> list[str]:
    """The image file names of the train (partition 0) or test (partition 2) split, in the file's order."""
    wanted, names = SPLITS[train], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or not fields[1].isdigit():
            raise CorruptDataError(f"{path}, line {number}: expected '<file>.jpg <0|1|2>', got {line!r}")
        if int(fields[1]) == wanted:
            names.append(fields[0])
    if not names:
        raise CorruptDataError(f"{path} lists no image of partition {wanted}")
    return names


def crop_resize(path: Path) -> np.ndarray:
    """One image: centre crop 140x140, resize to 64x64 (PIL bilinear), as uint8 ``[3, 64, 64]``."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            w, h = image.size
            left, top = round((w - CROP) / 2), round((h - CROP) / 2)  # torchvision's CenterCrop offsets
            image = image.crop((left, top, left + CROP, top + CROP)).resize((SIZE, SIZE), Image.BILINEAR)
            return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
    except OSError as err:
        raise CorruptDataError(f"{path} is not a readable image ({err})") from err


def _decode(folder: Path, names: list[str], cache: Path) -> np.ndarray:
    images = np.empty((len(names), 3, SIZE, SIZE), dtype=np.uint8)
    for i, name in enumerate(tqdm(names, desc=f"decoding CelebA into {cache.name}", unit="img", leave=False)):
        images[i] = crop_resize(folder / IMAGES / name)
    tmp = cache.with_name(f".{cache.stem}.partial.{os.getpid()}.npy")
    try:
        np.save(tmp, images)
        os.replace(tmp, cache)
    except OSError as err:  # a read-only data folder: decode again next time
        warnings.warn(f"cannot cache the decoded CelebA images as {cache}: {err}", RuntimeWarning, stacklevel=2)
    finally:
        tmp.unlink(missing_ok=True)
    return images


def load_celeba64(root: str | Path, train: bool, download: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """CelebA's train or test split at 64x64 (see the module docstring); labels are all 0."""
    folder = Path(root) / FOLDER
    if not (folder / PARTITION).is_file() and download:
        from torchvision.datasets import CelebA

        try:
            CelebA(str(root), split="all", download=True)
        except Exception as err:  # offline or rate-limited: say what to put where
            warnings.warn(f"CelebA download failed: {err}", RuntimeWarning, stacklevel=2)
    if not (folder / PARTITION).is_file() or not (folder / IMAGES).is_dir():
        raise DataNotFoundError(
            f"CelebA is not in {folder}: put the aligned images in {folder / IMAGES}/ (img_align_celeba.zip, "
            f"extracted) and {PARTITION} in {folder} (both from the CelebA site or its Google Drive)"
        )
    names = read_partition(folder / PARTITION, train)
    cache = folder / f"celeba{SIZE}_{'train' if train else 'test'}.npy"
    images = None
    if cache.is_file():
        try:
            images = np.load(cache, mmap_mode="r")
        except (OSError, ValueError) as err:
            warnings.warn(f"decoding CelebA again: the cache {cache} is unreadable ({err})", RuntimeWarning,
                          stacklevel=2)
    if images is None or images.shape != (len(names), 3, SIZE, SIZE) or images.dtype != np.uint8:
        images = _decode(folder, names, cache)
    return np.asarray(images), np.zeros(len(names), dtype=np.int64)


class CelebADataModule(ImageDataModule):
    """CelebA at 64x64 as flattened 12288-d vectors; the options are those of
    :class:`~deqscore.data.base.ImageDataModule` (use ``transform: pixels`` and ``random_flip: true`` as NCSN)."""

    name = "celeba"
    image_shape = (3, SIZE, SIZE)
    num_classes = 1

    def load_arrays(self, train: bool, *, download: bool) -> tuple[np.ndarray, np.ndarray]:
        return load_celeba64(self.data_dir, train, download=download)
