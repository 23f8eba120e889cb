"""``sample.py --fid``: the reference statistics, resolved before any sample is drawn, the samples' Inception
features taken as they are drawn, and the report written next to the samples.

``fid.json`` says what it describes: the sample count, the seed, the reference statistics (their label, file and
a digest of their moments) and ``samples_sha256``, the SHA-256 of the ``samples.npz`` beside it.
:func:`report_matches` tells whether a ``fid.json`` still describes the samples next to it; ``sample.py`` removes
one that does not whenever it replaces ``samples.npz``."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.errors import CorruptDataError, DataNotFoundError
from ..errors import ConfigError
from ..files import staged
from ..metrics.inception import InceptionFeatures
from ..metrics.quality import SampleFeatures
from ..metrics.reference import dataset_key, dataset_stats, load_stats, stats_file
from ..metrics.statistics import GaussianStats


def _usage(message: str) -> None:
    from .errors import usage_error

    usage_error(message)


#: the report written beside ``samples.npz``
REPORT_NAME = "fid.json"


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """The SHA-256 of the file at ``path``, read in chunks (memory stays one chunk)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def report_matches(report_path: str | Path, samples_path: str | Path) -> bool:
    """Whether the FID report at ``report_path`` describes the samples at ``samples_path`` (its ``samples_sha256`` is
    theirs). A report that does not parse or records no digest does not."""
    try:
        recorded = json.loads(Path(report_path).read_text()).get("samples_sha256")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(recorded, str) or not Path(samples_path).is_file():
        return False
    return recorded == file_sha256(samples_path)


def _moments_digest(reference: Any) -> str:
    import numpy as np

    return hashlib.sha256(b"".join(np.ascontiguousarray(np.asarray(a, np.float64)).tobytes()
                                   for a in (reference.mu, reference.sigma))).hexdigest()


def _data_module(source: dict[str, str], data_dir: str | None) -> Any:
    """The training data module a checkpoint records (its class and folder; ``data_dir`` overrides the folder)."""
    module_name, _, class_name = source["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    options = {k: v for k, v in source.items() if k not in ("class_path", "data_dir")}  # e.g. a folder's image size
    return cls(data_dir=data_dir or source["data_dir"], **options)


@dataclass
class FIDJob:
    """The FID of samples against reference statistics; see the module docstring."""

    extractor: InceptionFeatures
    reference: GaussianStats
    reference_label: str
    meta: dict[str, Any]
    features: SampleFeatures

    @classmethod
    def prepare(cls, args: argparse.Namespace, module: Any, device: torch.device) -> FIDJob:
        """Inception weights and reference statistics, or a one-line usage error naming what is missing."""
        try:
            extractor = InceptionFeatures(args.inception_weights).to(device)
            if args.fid_stats:
                reference, label = load_stats(args.fid_stats), f"the statistics in {args.fid_stats}"
                stats_path = Path(args.fid_stats)
            else:
                source = getattr(module, "data_source", None)
                if source is None:
                    _usage("--fid: the checkpoint records no training images to compare with; give --fid-stats")
                datamodule = _data_module(source, args.data_dir)
                reference = dataset_stats(datamodule, train=True, max_images=args.reference_images,
                                          root=args.stats_root, extractor=extractor)
                label = f"{datamodule.name} train ({reference.count} images)"
                stats_path = stats_file(dataset_key(datamodule, True, reference.count), args.stats_root)
        except (DataNotFoundError, CorruptDataError, ConfigError, FileNotFoundError, ValueError) as err:
            _usage(f"--fid: {err}")
        meta = {"checkpoint": str(args.checkpoint), "weights": "raw" if args.raw_weights else "averaged (if any)",
                "seed": args.seed, "final_denoise": getattr(getattr(module, "sampler", None), "final_denoise", None),
                "reference_stats": {"file": str(stats_path), "count": int(reference.count),
                                    "moments_sha256": _moments_digest(reference)}}
        return cls(extractor, reference, label, meta, SampleFeatures(extractor))

    def observing(self, draw: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
        """``draw`` that also adds the features of what it draws to :attr:`features`."""

        def observed(k: int) -> torch.Tensor:
            images = draw(k)
            self.features.add(images)
            return images

        return observed

    def finish(self, path: Path, samples: Path, num_samples: int) -> dict[str, Any]:
        """FID@N and KID of the samples just drawn, written with the sample count, the seed, the reference and the
        digest of ``samples`` (the file the features were taken from as it was written) to ``path`` (JSON,
        atomically); the report. Refused (``ValueError``) when the features seen are not ``num_samples``, the
        count in ``samples``: the report would describe other samples."""
        if self.features.stats.count != num_samples:
            raise ValueError(f"the FID features of {self.features.stats.count} samples were taken, but {samples} holds "
                             f"{num_samples}; no FID is reported")
        report = {**self.features.quality(self.reference, seed=self.meta.get("seed") or 0),
                  "reference": self.reference_label, **self.meta,
                  "samples": Path(samples).name, "samples_sha256": file_sha256(samples)}
        with staged([path]) as (tmp,):
            tmp.write_text(json.dumps(report, indent=1) + "\n")
        return report
