"""Load any deqscore checkpoint: the model family is read from the checkpoint itself.

>>> # module = load_module("checkpoints/demo/checkpoints/last.ckpt")   # the NICEModule (or other family)
"""

from __future__ import annotations

from pathlib import Path

import torch

from .base import FAMILY_KEY, CheckpointFamilyError, ScoreModule, family_registry


def load_module(path: str | Path, family: str | None = None, map_location: str = "cpu") -> ScoreModule:
    """Rebuild the LightningModule stored in ``path``; with ``family`` given, a checkpoint of another family
    raises :class:`CheckpointFamilyError`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:  # truncated or foreign files
        raise ValueError(f"{path} is not a readable PyTorch checkpoint: {err}") from err
    found = ckpt.get(FAMILY_KEY) if isinstance(ckpt, dict) else None
    registry = family_registry()
    if found not in registry:
        raise CheckpointFamilyError(
            f"{path} is not a deqscore checkpoint (model family {found!r}; known: {sorted(registry)})"
        )
    if family is not None and found != family:
        raise CheckpointFamilyError(f"{path} holds a {found!r} model, expected {family!r}")
    return registry[found].load_from_checkpoint(path, map_location=map_location)
