"""``sample.py --fid``: the reference statistics, resolved before any sample is drawn, the samples' Inception
features taken as they are drawn, and the report written next to the samples."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.errors import CorruptDataError, DataNotFoundError
from ..errors import ConfigError
from ..files import staged
from ..metrics.inception import InceptionFeatures
from ..metrics.quality import sample_quality
from ..metrics.reference import dataset_stats, load_stats
from ..metrics.statistics import FeatureStats


def _usage(message: str) -> None:
    from .errors import usage_error

    usage_error(message)


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
    reference: FeatureStats
    reference_label: str
    meta: dict[str, Any]
    stats: FeatureStats = field(default_factory=lambda: FeatureStats(keep=10_000))  # features kept for KID

    @classmethod
    def prepare(cls, args: argparse.Namespace, module: Any, device: torch.device) -> FIDJob:
        """Inception weights and reference statistics, or a one-line usage error naming what is missing."""
        try:
            extractor = InceptionFeatures(args.inception_weights).to(device)
            if args.fid_stats:
                reference, label = load_stats(args.fid_stats), f"the statistics in {args.fid_stats}"
            else:
                source = getattr(module, "data_source", None)
                if source is None:
                    _usage("--fid: the checkpoint records no training images to compare with; give --fid-stats")
                datamodule = _data_module(source, args.data_dir)
                reference = dataset_stats(datamodule, train=True, max_images=args.reference_images,
                                          root=args.stats_root, extractor=extractor)
                label = f"{datamodule.name} train ({reference.count} images)"
        except (DataNotFoundError, CorruptDataError, ConfigError, FileNotFoundError, ValueError) as err:
            _usage(f"--fid: {err}")
        meta = {"checkpoint": str(args.checkpoint), "weights": "raw" if args.raw_weights else "averaged (if any)",
                "seed": args.seed, "final_denoise": getattr(getattr(module, "sampler", None), "final_denoise", None)}
        return cls(extractor, reference, label, meta)

    def observing(self, draw: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
        """``draw`` that also adds the features of what it draws to :attr:`stats`."""

        def observed(k: int) -> torch.Tensor:
            images = draw(k)
            self.stats.update(self.extractor(images))
            return images

        return observed

    def finish(self, path: Path) -> dict[str, Any]:
        """FID@N and KID, written with the sample count and the reference to ``path`` (JSON, atomically); the report."""
        report = {**sample_quality(self.stats, self.reference, seed=self.meta.get("seed") or 0),
                  "reference": self.reference_label, **self.meta}
        with staged([path]) as (tmp,):
            tmp.write_text(json.dumps(report, indent=1) + "\n")
        return report
