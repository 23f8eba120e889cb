"""What the families' study evaluations share (each family's own is ``evaluate`` in its laboratory file,
:mod:`deqlab.families`).

Every evaluation runs through the project's own commands (``train.py test``, ``sample.py``) on the checkpoint
the unit names, so the study measures what a user of those commands would get. A DEQ's evaluation also measures
its trust figures on the first test batch (:mod:`.trust`).
"""

from __future__ import annotations

import json
from pathlib import Path

from deqscore.lightning.run_hooks import batch_inputs

from .trust import trust_figures

GRID = 100  # samples drawn for an image family's grid
COST_SAMPLES = 16  # samples of the sampler's cost, cold and warm (counts per sample, so one small batch suffices)
TRUST_BATCH = 128  # test rows of the trust figures


def test_metrics(run_dir: Path, checkpoint: Path, options: list[str], keys: tuple[str, ...]) -> dict:
    """``train.py test`` of ``checkpoint`` in its run: the ``test/<key>`` figures it logged, and for a DEQ the trust
    figures of the tested weights on the first test batch (``trust``)."""
    from deqscore.cli.train import main as train

    test = train(["test", f"--config={run_dir / 'config.yaml'}", f"--ckpt_path={checkpoint}", *options])
    logged = test.trainer.callback_metrics
    metrics = {key: float(logged[f"test/{key}"]) for key in keys if f"test/{key}" in logged}
    module = test.model
    if module.deq_layers():
        batch = next(iter(test.datamodule.test_dataloader()))
        x = module.prepare_batch(batch_inputs(batch).to(module.device)[:TRUST_BATCH])
        metrics["trust"] = trust_figures(module, x)
    return metrics


def scored_weights(evaluation: dict) -> list[str]:
    """``train.py test``'s options for the weights the protocol scores: a run's trained weights where its
    evaluation says ``weights: trained`` (its checkpoint's state_dict is their average where the run averaged)."""
    return ["--trainer.callbacks+=deqscore.lightning.TrainedWeights"] if evaluation.get("weights") == "trained" else []


def sample_quality(run_dir: Path, checkpoint: Path, seed: int, evaluation: dict) -> dict:
    """KID and FID@N of ``evaluation["samples"]`` samples of an image family's ``checkpoint`` (its averaged
    weights, or the trained ones where ``evaluation["weights"]`` says ``trained``) against the Inception features
    of the first ``evaluation["reference"]`` training images, cached under ``<runs-root>/fid_stats``."""
    out = run_dir / "samples"
    weights = ["--raw-weights"] if evaluation["weights"] == "trained" else []
    draw_samples(checkpoint, out, evaluation["samples"], seed,
                 ["--batch-size", "250", *weights, "--fid", "--reference-images", str(evaluation["reference"]),
                  "--stats-root", str(run_dir.parents[2] / "fid_stats")])
    report = json.loads((out / "fid.json").read_text())
    cost = sampler_cost(checkpoint, evaluation)
    return {"kid": report["kid"], "kid_std": report["kid_std"], "kid_se": report["kid_se"],
            "kid_subset_size": report["kid_subset_size"],
            "fid": report["fid"], "fid_samples": report["num_samples"], "reference": report["reference"],
            **({"sampling_cost": cost} if cost else {})}


def sampler_cost(checkpoint: Path, evaluation: dict) -> dict | None:
    """A DEQ's sampling cost on the weights the protocol scores: network evaluations per sample and solver
    iterations per evaluation, cold and warm (:meth:`~deqscore.lightning.base.ScoreModule.sampling_cost`); None
    for a network without a DEQ."""
    from deqscore.lightning import load_module

    module = load_module(checkpoint, raw_weights=evaluation["weights"] == "trained")
    module.sampler.progress = False
    return module.sampling_cost(COST_SAMPLES, seed=0) if module.deq_layers() else None


def draw_samples(checkpoint: Path, out: Path, n: int, seed: int, options: list[str] = ()) -> None:
    """``sample.py`` of ``checkpoint``: ``n`` samples and their grid (``samples.png``) in ``out``."""
    from deqscore.cli.sample import main as sample

    if sample(["--checkpoint", str(checkpoint), "--num-samples", str(n), "--out", str(out), "--seed", str(seed),
               *options]) != 0:
        raise RuntimeError(f"sample.py failed on {checkpoint}")
