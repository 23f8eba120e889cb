"""The study's families, read from their declarations (:mod:`deqscore.families`): each declaration's ``study``
entry gives the variants, training length and metrics, and its benchmark file's ``evaluate`` scores a trained run.
A new family declares these; nothing here names it.

Every evaluation runs through the project's own commands (``train.py test``, ``sample.py``) on the checkpoint
the unit names, so the study measures what a user of those commands would get. A DEQ's evaluation also measures
its trust figures on the first test batch (:mod:`.trust`); the helpers below are what the evaluations share.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

from ...families import declarations
from ...lightning.run_hooks import batch_inputs
from .core import Family, Variant
from .trust import trust_figures

GRID = 100  # samples drawn for an image family's grid
TRUST_BATCH = 128  # test rows of the trust figures


def test_metrics(run_dir: Path, checkpoint: Path, options: list[str], keys: tuple[str, ...]) -> dict:
    """``train.py test`` of ``checkpoint`` in its run: the ``test/<key>`` figures it logged, and for a DEQ the trust
    figures of the tested weights on the first test batch (``trust``)."""
    from ...cli.train import main as train

    test = train(["test", f"--config={run_dir / 'config.yaml'}", f"--ckpt_path={checkpoint}", *options])
    logged = test.trainer.callback_metrics
    metrics = {key: float(logged[f"test/{key}"]) for key in keys if f"test/{key}" in logged}
    module = test.model
    if module.deq_layers():
        batch = next(iter(test.datamodule.test_dataloader()))
        x = module.prepare_batch(batch_inputs(batch).to(module.device)[:TRUST_BATCH])
        metrics["trust"] = trust_figures(module, x)
    return metrics


def draw_samples(checkpoint: Path, out: Path, n: int, seed: int, options: list[str] = ()) -> None:
    """``sample.py`` of ``checkpoint``: ``n`` samples and their grid (``samples.png``) in ``out``."""
    from ...cli.sample import main as sample

    if sample(["--checkpoint", str(checkpoint), "--num-samples", str(n), "--out", str(out), "--seed", str(seed),
               *options]) != 0:
        raise RuntimeError(f"sample.py failed on {checkpoint}")


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
        evaluate = importlib.import_module(declared.bench).evaluate
        out[name] = Family(name, study.title, study.setting, study.iterations, variants, study.metrics, evaluate,
                           study.groups, study.choices, study.context)
    return out
