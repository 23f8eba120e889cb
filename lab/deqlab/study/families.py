"""The study's families: every declared family (:mod:`deqscore.families`) with a study entry
(:data:`deqlab.entries.STUDIES`, the variants, training length and metrics), and the family's laboratory file
(:mod:`deqlab.families`) its ``evaluate``, which scores a trained run. Nothing here names a family.
"""

from __future__ import annotations

import functools

from ..entries import study_entries
from ..families import family_file
from .core import Family, Variant


@functools.cache
def families() -> dict[str, Family]:
    """Every declared family with a study entry, its evaluation from its benchmark file."""
    out = {}
    for name, (declared, study) in study_entries().items():
        variants = {key: Variant(v.config_path(declared), v.label, v.overrides, v.steps_per_iteration, v.trained)
                    for key, v in study.variants.items()}
        evaluate = family_file(name).evaluate
        out[name] = Family(name, study.title, study.setting, study.iterations, variants, study.metrics, evaluate,
                           study.groups, study.choices, study.context)
    return out
