"""The EDM family's study evaluation (its benchmark rows are the GPU program's, :mod:`deqlab.gpu_images`)."""

from __future__ import annotations

from pathlib import Path

from ..study.core import Variant
from ..study.evaluation import sample_quality, scored_weights, test_metrics


def evaluate(run_dir: Path, checkpoint: Path, variant: Variant, seed: int, evaluation: dict) -> dict:
    """The study's evaluation of a trained EDM run (see :mod:`deqlab.study.evaluation`): the held-out denoising
    loss (``train.py test``: the training loss on the test images with fixed draws of sigma and noise), with a
    DEQ's trust figures, and KID and FID@N of its Heun samples."""
    return {**test_metrics(run_dir, checkpoint, scored_weights(evaluation), ("loss",)),
            **sample_quality(run_dir, checkpoint, seed, evaluation)}
