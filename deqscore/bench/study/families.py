"""The four families of the study: their variants, the training length at budget 1 and how a trained run is
evaluated. A new family is one more :class:`~deqscore.bench.study.core.Family` here and an entry in the protocol
(``benchmarks/protocol/``), which fixes the budget, seeds, evaluation sizes and the options every variant shares.

Every evaluation runs through the project's own commands (``train.py test``, ``sample.py``) on the checkpoint
the unit names, so the study measures what a user of those commands would get. A DEQ's evaluation also measures
its trust figures on the first test batch (:mod:`.trust`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ...lightning.dkef import LOG_Z_PROPOSALS
from ...lightning.run_hooks import batch_inputs
from ..dkef import data_root
from .core import Family, Metric, Variant
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


# ----------------------------------------------------------------------------------------------------- NICE
def evaluate_nice(run_dir: Path, checkpoint: Path, variant: Variant, seed: int, evaluation: dict) -> dict:
    options = ["--model.init_args.exact_sm_batches=1",
               f"--model.init_args.exact_sm_samples={evaluation['exact_sm_images']}"]
    metrics = test_metrics(run_dir, checkpoint, options, ("log_likelihood", "bits_per_dim", "exact_sm", "loss"))
    draw_samples(checkpoint, run_dir / "samples", GRID, seed)
    return metrics


NICE = Family(
    name="nice",
    title="NICE on MNIST",
    setting=("MNIST with the `logit_squeeze` transform (invertible: exact bits/dim), batch 128, sliced score "
             "matching, Adam 1e-4, the paper's sizes (4 couplings of width 1000; the reference design: 2). Test "
             "log-likelihood and bits/dim on the 10,000 test images; test exact SM on the first test images "
             "(784 backward passes through the converged model each)."),
    iterations=840,  # two epochs of the 54,000 training images
    variants={
        "explicit": Variant("configs/nice/explicit.yaml", "shallow"),
        "explicit_deep": Variant("configs/nice/explicit_deep.yaml", "deep"),
        "deq": Variant("configs/nice/deq.yaml", "deq"),
        "deq_reference": Variant("configs/nice/deq_reference.yaml", "deq_reference"),
    },
    metrics=(Metric("bits_per_dim", "test bits/dim", False), Metric("log_likelihood", "test log-lik. (nats)", True),
             Metric("exact_sm", "test exact SM", False)),
    evaluate=evaluate_nice,
    context=("NICE trained by maximum likelihood to convergence is reported at about 4.36 bits/dim on MNIST; these "
             "runs train by SSM for two epochs at budget 1 (a fraction of one at smaller budgets), so their "
             "bits/dim lie far above it."),
)


# ----------------------------------------------------------------------------------------------------- DKEF
def evaluate_dkef(run_dir: Path, checkpoint: Path, variant: Variant, seed: int, evaluation: dict) -> dict:
    options = [f"--model.init_args.final_log_z_samples={evaluation['log_z_samples']}",
               f"--model.init_args.log_z_proposal={evaluation['log_z_proposal']}"]
    metrics = test_metrics(run_dir, checkpoint, options,
                           ("log_likelihood", "log_z", "log_z_stderr", "log_z_ess", "exact_sm", "loss"))
    return metrics | {"log_z_estimator": f"importance sampling, {evaluation['log_z_proposal']} proposal, "
                                         f"{evaluation['log_z_samples']:,} draws"}


DKEF = Family(
    name="dkef",
    title="DKEF on UCI data",
    setting=("RedWine, WhiteWine and Parkinsons (whitened with a transform fitted on the training rows; the "
             "log-likelihood is in the data's own units, the whitening's Jacobian added), 200 centres, features "
             "of width 30, SSM-VR, Adam 1e-2, batch 200; the "
             "model evaluated is the family's final one (best validation weights, alpha on the whole training set, "
             "log lambda fine-tuned). log Z by importance sampling from a defensive mixture proposal (half the "
             "broad Gaussian N(0, 4 I), half Gaussians at the training points); its effective sample size is "
             "reported, and a figure resting on fewer than 100 effective draws is marked unreliable."),
    iterations=1000,
    variants={
        "explicit": Variant("configs/dkef/explicit_shallow.yaml", "shallow"),
        "explicit_deep": Variant("configs/dkef/explicit_deep.yaml", "deep"),
        "deq": Variant("configs/dkef/deq.yaml", "deq"),
        "deq_faithful": Variant("configs/dkef/deq.yaml", "deq_faithful",
                                ("--model.init_args.net.init_args.deq.init_args.phantom_steps=12",)),
        "deq_reference": Variant("configs/dkef/deq_reference.yaml", "deq_reference"),
    },
    metrics=(Metric("log_likelihood", "test log-lik. (nats / point)", True), Metric("exact_sm", "test exact SM",
                                                                                     False),
             Metric("log_z_ess", "ESS of log Z", True)),
    evaluate=evaluate_dkef,
    choices={"log_z_proposal": LOG_Z_PROPOSALS},
    groups={name: (f"--data.init_args.dataset={name}", f"--data.init_args.root={data_root()}")
            for name in ("redwine", "whitewine", "parkinsons")},
)


# ------------------------------------------------------------------------------------------------------ VAE
def evaluate_vae(run_dir: Path, checkpoint: Path, variant: Variant, seed: int, evaluation: dict) -> dict:
    options = ["--model.init_args.ais_batches=1", f"--data.init_args.eval_batch_size={evaluation['ais_images']}",
               f"--model.init_args.ais_steps={evaluation['ais_steps']}",
               f"--model.init_args.ais_chains={evaluation['ais_chains']}"]
    metrics = test_metrics(run_dir, checkpoint, options, ("ais_log_likelihood", "loss"))
    loss = metrics.pop("loss")
    if variant.role == "classical":  # the Gaussian encoder's loss is the negative ELBO; the implicit one has none
        metrics["elbo"] = -loss
    draw_samples(checkpoint, run_dir / "samples", GRID, seed)
    return metrics


VAE = Family(
    name="vae",
    title="VAE with an implicit encoder on MNIST",
    setting=("Dynamically binarised MNIST, MLP encoder and decoder (784-256-256, z 8), RMSprop 1e-3, batch 128; "
             "the implicit encoder's entropy gradient from a score network (explicit MLP, deep explicit MLP, or the "
             "DEQ) trained by SSM-VR with 2 score steps per encoder/decoder step, so an iteration is 3 optimiser "
             "steps (the Gaussian VAE: 1). Test log-likelihood by AIS (HMC, 10 leapfrog steps) on the first test "
             "images; the Gaussian VAE's ELBO on all 10,000."),
    iterations=6000,
    variants={
        "explicit": Variant("configs/vae/explicit_mnist.yaml", "shallow", steps_per_iteration=3),
        "explicit_deep": Variant("configs/vae/explicit_deep_mnist.yaml", "deep", steps_per_iteration=3),
        "deq": Variant("configs/vae/deq_mnist.yaml", "deq", steps_per_iteration=3),
        "gaussian": Variant("configs/vae/gaussian_mnist.yaml", "classical"),
    },
    metrics=(Metric("ais_log_likelihood", "test AIS log-lik. (nats)", True), Metric("elbo", "test ELBO (nats)", True)),
    evaluate=evaluate_vae,
)


# ----------------------------------------------------------------------------------------------------- NCSN
def evaluate_ncsn(run_dir: Path, checkpoint: Path, variant: Variant, seed: int, evaluation: dict) -> dict:
    out = run_dir / "samples"
    weights = ["--raw-weights"] if evaluation["weights"] == "trained" else []
    draw_samples(checkpoint, out, evaluation["samples"], seed,
                 ["--batch-size", "250", *weights, "--fid", "--reference-images", str(evaluation["reference"]),
                  "--stats-root", str(run_dir.parents[2] / "fid_stats")])  # <runs-root>/fid_stats
    report = json.loads((out / "fid.json").read_text())
    return {"kid": report["kid"], "kid_std": report["kid_std"], "kid_subset_size": report["kid_subset_size"],
            "fid": report["fid"], "fid_samples": report["num_samples"], "reference": report["reference"]}


NCSN = Family(
    name="ncsn",
    title="NCSN on MNIST",
    setting=("MNIST pixels in [0, 1], annealed DSM over 10 noise levels (1 to 0.01), base width 32, batch 64, Adam "
             "1e-3; samples by annealed Langevin dynamics with the sampler and weights (trained or their EMA) the "
             "protocol fixes; the learning curve is that of the scored weights. KID (mean and standard deviation "
             "over 100 subsets) and FID@N of the same N samples against the Inception features of the first MNIST "
             "training images; the untrained row is the DEQ network at initialisation, through the same sampling "
             "and scoring."),
    iterations=600,
    variants={
        "explicit": Variant("configs/ncsn/explicit_mnist.yaml", "shallow"),
        "ncsnv2": Variant("configs/ncsn/ncsnv2_mnist.yaml", "deep"),
        "deq": Variant("configs/ncsn/deq_mnist.yaml", "deq"),
        "deq_reference": Variant("configs/ncsn/deq_mnist.yaml", "deq_reference",
                                 ("--model.init_args.net.init_args.body=deq_full",)),
        "untrained": Variant("configs/ncsn/deq_mnist.yaml", "untrained", trained=False),
    },
    metrics=(Metric("kid", "KID", False), Metric("fid", "FID@N", False)),
    evaluate=evaluate_ncsn,
    choices={"weights": ("trained", "averaged")},
)

FAMILIES = {family.name: family for family in (NICE, DKEF, VAE, NCSN)}
