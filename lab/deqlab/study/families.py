"""The study's families, read from their declarations (:mod:`deqscore.families`): each declaration's ``study``
entry gives the variants, training length and metrics, and the family's laboratory file
(:mod:`deqlab.families`) its ``evaluate``, which scores a trained run. A new family declares these; nothing here
names it.
"""

from __future__ import annotations

import functools

from deqscore.families import declarations

from ..families import family_file
from .core import Family, Variant


@functools.cache
def families() -> dict[str, Family]:
    """Every declared family with a study entry, its evaluation from its benchmark file."""
    out = {}
    for name, declared in declarations().items():
        study = declared.study
        if study is None:
            continue
        variants = {key: Variant(declared.variant_config(v), v.label, v.overrides, v.steps_per_iteration, v.trained)
                    for key, v in study.variants.items()}
        evaluate = family_file(name).evaluate
        out[name] = Family(name, study.title, study.setting, study.iterations, variants, study.metrics, evaluate,
                           study.groups, study.choices, study.context)
    return out
