"""``ImageFolderDataModule``: your own images, a folder of PNG/JPEG files, as a data set.

``data_dir`` is the folder. Every ``.png``, ``.jpg`` and ``.jpeg`` file below it is an image (class sub-folders
are allowed and ignored; hidden files and folders, such as the LMDB cache, are skipped). If the folder holds
``train/`` and ``test/`` sub-folders, they are the two splits; otherwise ``test_fraction`` of the files (a
seeded choice) is held out as the test split. Validation is held out of the train split as for every image data
module (``val_fraction``).

Each image is resized so that its shorter side is ``image_size`` (PIL's bilinear filter, antialiased when
shrinking) and centre-cropped to ``image_size`` x ``image_size``, as torchvision's ``Resize`` then
``CenterCrop``. The channels come from the files: all greyscale (``L``) gives 1, all ``RGB`` gives 3; a folder
mixing them, or a file of another mode (palette, RGBA, CMYK), is refused with a message naming the file, as is an
unreadable or truncated file, unless ``skip_unreadable`` is set, which skips such files and logs how many.

Decoding is done once per process and split; ``use_lmdb: true`` (recommended for folders of more than a few
thousand images, and with DataLoader workers) stores the decoded images once in a checksummed LMDB cache in
``<data_dir>/.deqscore_lmdb_<image_size>/``. Replace the cache (delete it) after changing the images.

Command line::

    python train.py fit --config configs/ncsn/deq_mnist.yaml --data deqscore.data.ImageFolderDataModule \\
        --data.init_args.data_dir PATH --data.init_args.image_size 32 --model.init_args.net.init_args.channels 3
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import numpy as np
from pytorch_lightning.utilities import rank_zero_warn

from deqscore.data.base import ImageDataModule
from deqscore.data.errors import CorruptDataError, DataNotFoundError
from deqscore.errors import check_count, check_real

__all__ = ["ImageFolderDataModule", "list_images", "load_image"]

SUFFIXES = (".png", ".jpg", ".jpeg")
MODES = {"L": 1, "RGB": 3}


def list_images(folder: Path) -> list[Path]:
    """The image files below ``folder`` in sorted order, hidden files and folders skipped."""
    files = (p for p in folder.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file())
    return sorted(p for p in files if not any(part.startswith(".") for part in p.relative_to(folder).parts))


def load_image(path: Path, size: int) -> tuple[np.ndarray, str]:
    """One image resized (shorter side ``size``) and centre-cropped, as uint8 ``[C, size, size]``, and its mode."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()  # decodes the whole file, so a truncated one fails here
            mode = image.mode
            if mode not in MODES:
                raise CorruptDataError(f"{path} has image mode {mode!r}; accepted: {', '.join(MODES)} "
                                       "(convert it, or set skip_unreadable to leave it out)")
            w, h = image.size
            scale = size / min(w, h)
            image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
            w, h = image.size
            left, top = round((w - size) / 2), round((h - size) / 2)  # torchvision's CenterCrop offsets
            array = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as err:  # PIL's errors for unknown, truncated or damaged files
        raise CorruptDataError(f"{path} is not a readable image ({type(err).__name__}: {err})") from err
    return (array[None] if array.ndim == 2 else array.transpose(2, 0, 1)), mode


class ImageFolderDataModule(ImageDataModule):
    """A folder of PNG/JPEG images at ``image_size`` x ``image_size`` (see the module docstring); labels all 0.

    Besides the options of :class:`~deqscore.data.base.ImageDataModule`: ``image_size`` (the side after
    resizing and centre-cropping), ``test_fraction`` (held out as the test split when the folder has no
    ``train/`` and ``test/``) and ``skip_unreadable``. ``data_dir`` has no default: it is your folder.
    """

    name = "folder"
    image_shape = (3, 32, 32)  # the class's placeholder; each instance takes its shape from its files
    num_classes = 1

    def __init__(self, data_dir: str, image_size: int = 32, test_fraction: float = 0.1,
                 skip_unreadable: bool = False, **kwargs: Any) -> None:
        check_count("ImageFolderDataModule image_size", image_size)
        check_real("ImageFolderDataModule test_fraction", test_fraction, high=1.0, high_closed=False)
        self.image_size, self.test_fraction, self.skip_unreadable = image_size, test_fraction, skip_unreadable
        self.data_dir = data_dir
        # one name per folder: the FID reference statistics are cached under the data set's name
        resolved = Path(data_dir).resolve()
        self.name = f"folder-{resolved.name}-{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
        self._splits = self._split_files()
        channels = MODES[load_image(self._splits[True][0], image_size)[1]] if self._readable_first() else 3
        self.image_shape = (channels, image_size, image_size)
        self.dim = math.prod(self.image_shape)
        self._decoded: dict[bool, np.ndarray] = {}
        super().__init__(data_dir=data_dir, **kwargs)

    @property
    def source_options(self) -> dict[str, Any]:
        """What rebuilds this data set after training (recorded in checkpoints beside the class and folder)."""
        return {"image_size": self.image_size, "test_fraction": self.test_fraction,
                "skip_unreadable": self.skip_unreadable}

    # -- the files ---------------------------------------------------------------------------------------

    def _split_files(self) -> dict[bool, list[Path]]:
        folder = Path(self.data_dir)
        if not folder.is_dir():
            raise DataNotFoundError(f"ImageFolderDataModule data_dir: {folder.resolve()} is not a folder; give the "
                                    "folder of your PNG/JPEG images")
        if (folder / "train").is_dir() and (folder / "test").is_dir():
            splits = {True: list_images(folder / "train"), False: list_images(folder / "test")}
        else:
            files = list_images(folder)
            order = np.random.default_rng(2019).permutation(len(files))
            n_test = int(round(self.test_fraction * len(files)))
            held_out = set(order[:n_test].tolist())
            splits = {True: [f for i, f in enumerate(files) if i not in held_out],
                      False: [f for i, f in enumerate(files) if i in held_out]}
        for train, files in splits.items():
            if not files:
                where = folder / ("train" if train else "test") if (folder / "train").is_dir() else folder
                raise DataNotFoundError(f"{where.resolve()} holds no image for the {'train' if train else 'test'} "
                                        f"split (files ending in {', '.join(SUFFIXES)} are read)", key="data_dir")
        return splits

    def _readable_first(self) -> bool:
        """Whether the first train file decodes (with ``skip_unreadable``, the mode comes from the first that does)."""
        while True:
            try:
                load_image(self._splits[True][0], self.image_size)
                return True
            except CorruptDataError:
                if not self.skip_unreadable or len(self._splits[True]) == 1:
                    raise
                self._splits[True] = self._splits[True][1:]

    def load_arrays(self, train: bool, *, download: bool) -> tuple[np.ndarray, np.ndarray]:
        """The decoded split ``(uint8 [N, C, S, S], zero labels [N])``; ``download`` is ignored (nothing to fetch)."""
        if train not in self._decoded:
            self._decoded[train] = self._decode(self._splits[train])
        images = self._decoded[train]
        return images, np.zeros(len(images), dtype=np.int64)

    def _decode(self, files: list[Path]) -> np.ndarray:
        images, skipped, mode = [], 0, None
        for path in files:
            try:
                image, this_mode = load_image(path, self.image_size)
            except CorruptDataError:
                if not self.skip_unreadable:
                    raise
                skipped += 1
                continue
            mode = mode or this_mode
            if this_mode != mode:
                if not self.skip_unreadable:
                    raise CorruptDataError(f"{path} has image mode {this_mode!r}, the folder's earlier images "
                                           f"{mode!r}: convert the folder to one mode")
                skipped += 1
                continue
            images.append(image)
        if skipped:
            rank_zero_warn(f"{self.data_dir}: skipped {skipped} unreadable or other-mode image(s) of {len(files)}")
        if not images:
            raise DataNotFoundError(f"{Path(self.data_dir).resolve()}: no readable image in this split")
        return np.stack(images)

    def lmdb_path(self, train: bool) -> Path:
        return Path(self.data_dir) / f".deqscore_lmdb_{self.image_size}" / ("train" if train else "test")
