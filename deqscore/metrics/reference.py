"""Reference statistics of a data set, computed once and cached (docs/method.md section 4.4).

Statistics are cached as ``.npz`` under ``datasets/fid_stats/``, keyed by data set, split, resolution and image
count (:func:`dataset_stats`), with a checksum of everything stored; a file that does not verify is recomputed with
a warning, never trusted. Beside the moments (FID) the file keeps the features of up to :data:`KID_REFERENCE`
reference images (KID needs features, not moments).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..files import staged
from .inception import FEATURE_DIM, InceptionFeatures
from .statistics import FeatureStats, GaussianStats

STATS_ROOT = "datasets/fid_stats"
KID_REFERENCE = 5000  # reference images whose features are kept for KID


def _digest(*arrays: np.ndarray) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def stats_file(key: dict[str, Any], root: str | Path = STATS_ROOT) -> Path:
    """``<root>/<dataset>_<split>_<resolution>_n<count>.npz`` for ``key`` (dataset, split, resolution, count)."""
    return Path(root) / f"{key['dataset']}_{key['split']}_{key['resolution']}_n{key['count']}.npz"


def save_stats(path: str | Path, stats: GaussianStats, key: dict[str, Any] | None = None) -> None:
    """Write ``mu``, ``sigma``, ``count``, the kept features, the key (JSON) and a checksum of all of them to
    ``path``, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    features = np.zeros((0, len(stats.mu)), np.float32) if stats.features is None else stats.features
    key_text = json.dumps(key or {}, sort_keys=True)
    with staged([path]) as (tmp,):
        np.savez(tmp, mu=stats.mu, sigma=stats.sigma, count=stats.count, features=features, key=key_text,
                 sha256=_digest(stats.mu, stats.sigma, features, np.frombuffer(key_text.encode(), np.uint8)))


def load_stats(path: str | Path, key: dict[str, Any] | None = None, dim: int = FEATURE_DIM,
               verified: bool = False) -> GaussianStats:
    """Statistics from an ``.npz`` with ``mu`` and ``sigma`` (ours, or published ones); raises ``ValueError`` when
    the file is unreadable, of the wrong shapes, non-finite, or (for ours) fails its checksum or ``key``. With
    ``verified`` (the cache) a file without its key and checksum is refused too."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no FID statistics at {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            mu, sigma = np.asarray(data["mu"], np.float64), np.asarray(data["sigma"], np.float64)
            count = int(data["count"]) if "count" in data else 0
            digest = str(data["sha256"]) if "sha256" in data else None
            key_text = str(data["key"]) if "key" in data else None
            stored_key = json.loads(key_text) if key_text is not None else None
            features = np.asarray(data["features"], np.float32) if "features" in data else None
    except Exception as err:  # zip, pickle or key errors all mean: not a statistics file
        raise ValueError(f"{path} is not a readable FID statistics file ({type(err).__name__}: {err})") from err
    if mu.shape != (dim,) or sigma.shape != (dim, dim):
        raise ValueError(f"{path}: mu {mu.shape} and sigma {sigma.shape}, expected ({dim},) and ({dim}, {dim})")
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise ValueError(f"{path}: non-finite statistics")
    if verified and (digest is None or stored_key is None):
        raise ValueError(f"{path} has no key or checksum (not written by this version)")
    if digest is not None and (features is None or key_text is None or digest != _digest(
            mu, sigma, features, np.frombuffer(key_text.encode(), np.uint8))):
        raise ValueError(f"{path}: checksum mismatch (the file was altered, truncated or written by another version)")
    if key is not None and stored_key is not None and stored_key != json.loads(json.dumps(key, sort_keys=True)):
        raise ValueError(f"{path}: computed for {stored_key}, not {key}")
    return GaussianStats(mu, sigma, count, features if features is not None and len(features) else None)


def cached_stats(key: dict[str, Any], compute: Callable[[], FeatureStats], root: str | Path = STATS_ROOT,
                 write: bool = True) -> GaussianStats:
    """The statistics of ``key`` from the cache, or ``compute()`` and cache them (``write``); a cached file that
    does not verify is recomputed with a warning, never trusted."""
    path = stats_file(key, root)
    if path.exists():
        try:
            return load_stats(path, key, verified=True)
        except ValueError as err:
            warnings.warn(f"recomputing FID statistics: {err}", RuntimeWarning, stacklevel=2)
    stats = compute().gaussian()
    if write:
        save_stats(path, stats, key)
    return stats


def image_stats(images: np.ndarray | torch.Tensor, extractor: InceptionFeatures, batch_size: int = 100,
                desc: str = "FID features") -> FeatureStats:
    """Feature statistics of ``images`` ``[N, C, H, W]`` (uint8 or float in [0, 1]), in batches."""
    stats = FeatureStats(keep=KID_REFERENCE)
    for start in tqdm(range(0, len(images), batch_size), desc=desc, unit="batch", leave=False):
        stats.update(extractor(torch.as_tensor(np.asarray(images[start : start + batch_size]))))
    return stats


def dataset_key(datamodule: Any, train: bool, count: int) -> dict[str, Any]:
    """The cache key of the reference statistics of ``count`` images of a data module's train (or test) split."""
    shape = tuple(datamodule.image_shape)
    return {"dataset": datamodule.name, "split": "train" if train else "test", "resolution": f"{shape[1]}x{shape[2]}",
            "count": count}


def dataset_stats(
    datamodule: Any,
    train: bool = True,
    max_images: int | None = None,
    root: str | Path = STATS_ROOT,
    extractor: InceptionFeatures | None = None,
    barrier: Callable[[], None] | None = None,
    is_writer: bool = True,
) -> GaussianStats:
    """Reference statistics of an image data module's official train (or test) split, at most ``max_images``,
    cached (:func:`cached_stats`). Under DDP pass the strategy's ``barrier``: the writer process computes and saves
    them, the others read the file after the barrier."""
    images = datamodule.raw_images(train)
    images = images[:max_images] if max_images else images
    key = dataset_key(datamodule, train, len(images))
    extractor = extractor or InceptionFeatures()

    def compute() -> FeatureStats:
        return image_stats(images, extractor, desc=f"FID statistics of {datamodule.name} {key['split']}")

    if is_writer:
        stats = cached_stats(key, compute, root)
    if barrier is not None:
        barrier()
    if not is_writer:
        stats = cached_stats(key, compute, root, write=False)
    return stats
