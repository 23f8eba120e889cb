"""The laboratory's entries of each model family, keyed by the family's name: its depth-section entries
(:mod:`.depth`) and its study entry (:mod:`.study`). The family itself is declared in the library
(:mod:`deqscore.families`); an entry counts only while its family is declared, so a family without a declaration
is gone from the benchmark and the study too. A family's benchmark section and study evaluation are its file
``deqlab/families/<name>.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deqscore.families import ROOT, Declaration, declarations
from deqscore.lightning.dkef import LOG_Z_PROPOSALS

# option pieces the entries share
NET = "--model.init_args.net.init_args"
#: the study's deq_implicit variant: the family's DEQ with the exact fixed point's derivatives of every order
IMPLICIT = (f"{NET}.deq.init_args.backward=implicit",)
MNIST_WORKERS = ["--data.init_args.num_workers", "0"]
TINY_MNIST = ["--data.init_args.train_subset", "32", "--data.init_args.val_subset", "16",
              "--data.init_args.test_subset", "16", "--data.init_args.batch_size", "8",
              "--data.init_args.eval_batch_size", "8", *MNIST_WORKERS]
UCI = str(ROOT / "datasets" / "uci")  # the UCI files shipped with the project


@dataclass(frozen=True)
class Depth:
    """An entry of the depth section: activation memory against depth for one DEQ config of the family.

    ``inputs`` and ``loss`` name how a measured step is fed and what it differentiates (the section's
    ``INPUTS`` and ``LOSSES``); ``train_args``: the short training run measuring the effective depth, per mode
    (None: no real data offline, no effective depth)."""

    label: str
    config: str  # relative to the repository
    sizes: dict[str, dict]
    batch: dict[str, int]
    inputs: str
    loss: str = "module"
    train_args: dict[str, list[str]] | None = None
    deq_options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StudyVariant:
    """One network of the study: the config of a role (or another config file), with overrides."""

    role: str  # a key of Declaration.configs, or "classical" / "untrained" with ``config``
    # "shallow", "deep", "deq", "deq_faithful", "deq_implicit", "deq_reference", "classical" or "untrained"
    label: str
    overrides: tuple[str, ...] = ()
    steps_per_iteration: int = 1  # optimiser steps per training iteration (the implicit VAE: 2 score + 1)
    trained: bool = True  # False: the network at initialisation, through the same evaluation
    config: str | None = None  # a config file of the folder outside the roles (the Gaussian VAE)

    def config_path(self, declared: Declaration) -> str:
        """The variant's config, relative to the repository."""
        return f"configs/{declared.name}/{self.config}" if self.config else declared.config(self.role)


@dataclass(frozen=True)
class Metric:
    key: str  # in a unit's metrics
    label: str
    higher_is_better: bool


@dataclass(frozen=True)
class Study:
    """What the family brings to the reproduction study (the protocol fixes budget, seeds and evaluation sizes).
    ``iterations``: the training length at budget 1; ``metrics[0]``: the quality the claim is judged on;
    ``groups``: the data sets with their fit overrides."""

    title: str
    setting: str
    iterations: int
    variants: dict[str, StudyVariant]
    metrics: tuple[Metric, ...]
    groups: dict[str, tuple[str, ...]] = field(default_factory=lambda: {"mnist": ()})
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    context: str = ""


#: family -> its depth-section entries, by entry name
DEPTHS: dict[str, dict[str, Depth]] = {
    "nice": {"nice": Depth(
        "NICE m-net", "configs/nice/deq.yaml",
        {"full": {"net.dim": 784}, "quick": {"net.dim": 16, "net.hidden": 16, "net.n_couplings": 2}},
        {"full": 128, "quick": 8}, inputs="gaussian",
        train_args={"full": ["--trainer.max_steps", "300", *MNIST_WORKERS],
                    "quick": ["--trainer.max_steps", "2", f"{NET}.hidden", "16", "--model.init_args.exact_sm_samples",
                              "4", *TINY_MNIST]},
    )},
    "dkef": {"dkef": Depth(
        "DKEF feature net", "configs/dkef/deq.yaml",
        {"full": {"net.dim": 11}, "quick": {"net.dim": 11, "net.hidden": 8, "net.n_centres": 10}},
        {"full": 200, "quick": 20}, inputs="dkef_centres",
        train_args={"full": ["--trainer.max_steps", "200", "--data.init_args.root", UCI,
                             "--model.init_args.final_lambda_steps", "0"],
                    "quick": ["--trainer.max_steps", "2", "--data.init_args.root", UCI, f"{NET}.hidden", "8",
                              f"{NET}.n_centres", "10", "--model.init_args.alpha_points", "40",
                              "--model.init_args.log_z_samples", "500", "--model.init_args.final_log_z_samples",
                              "500", "--model.init_args.log_z_chunk", "250", "--model.init_args.final_lambda_steps",
                              "0", "--model.init_args.exact_sm_batches", "1", "--trainer.limit_val_batches", "1"]},
    )},
    "ncsn": {"ncsn": Depth(
        "NCSN body (MNIST)", "configs/ncsn/deq_mnist.yaml",
        {"full": {"net.dim": 784}, "quick": {"net.dim": 64, "net.ngf": 4, "n_levels": 3}},
        {"full": 8, "quick": 4}, inputs="pixels",
        train_args={"full": ["--trainer.max_steps", "150", "--data.init_args.batch_size", "32", *MNIST_WORKERS],
                    "quick": ["--trainer.max_steps", "2", f"{NET}.ngf", "4", "--model.init_args.n_levels", "3",
                              *TINY_MNIST]},
        # the config trains DSM with IFT; the curves compare phantom steps, the stacks backpropagate directly
        deq_options={"net.deq.backward": "phantom"},
    )},
    "edm": {"edm": Depth(
        "EDM denoiser middle (MNIST)", "configs/edm/deq_mnist.yaml",
        {"full": {"net.dim": 784}, "quick": {"net.dim": 784, "net.ngf": 4}},
        {"full": 64, "quick": 4}, inputs="pixels",
        # the config trains with IFT (exact for EDM's first-order loss); the curves compare phantom steps
        deq_options={"net.deq.backward": "phantom"},
    )},
    "vae": {
        "vae_mlp": Depth(
            "VAE score net (MNIST MLP)", "configs/vae/deq_mnist.yaml",
            {"full": {"net.dim": 784}, "quick": {"net.dim": 784, "net.hidden": 16}},
            {"full": 128, "quick": 8}, inputs="pixels", loss="vae_score",
            train_args={"full": ["--trainer.max_steps", "900", *MNIST_WORKERS],
                        "quick": ["--trainer.max_steps", "3", f"{NET}.hidden", "16",
                                  "--model.init_args.val_ais_steps", "5", *TINY_MNIST]},
        ),
        "vae_conv": Depth(
            "VAE score net (conv, 32x32)", "configs/vae/deq_cifar10.yaml",
            {"full": {"net.dim": 3 * 32 * 32}, "quick": {"net.dim": 3 * 16 * 16, "net.nef": 4}},
            {"full": 8, "quick": 4}, inputs="pixels", loss="vae_score",
        ),
    },
}

# the image units recorded before the fix of the checkpoint they score (said under both families' settings)
BEFORE_TRAINED_WEIGHTS_FIX = (
    " Units recorded before commit 0b28484 (the GPU units of 2026-11-27 and the first CPU units) scored the weights' "
    "average where the protocol names the trained weights: the checkpoint a unit scores is saved after fit, and "
    "Lightning's averaging had put the average in the trained weights' place by then (an untrained control's "
    "average is its initialisation: its reruns at that commit give it bit for bit). Each is replaced as the CPU "
    "chain reaches it (`JOBS=2 benchmarks/results/study/cpu_units.sh start edm`, then `ncsn`: one family at a "
    "time on both cores).")


#: family -> its study entry
STUDIES: dict[str, Study] = {
    "nice": Study(
        title="NICE on MNIST",
        setting=("MNIST with the `logit_squeeze` transform (invertible: exact bits/dim), batch 128, sliced score "
                 "matching, Adam at each row's learning rate, the paper's sizes (4 couplings of width 1000; the "
                 "reference design: 2). Test log-likelihood and bits/dim on the 10,000 test images; test exact SM "
                 "on the first test images (784 backward passes through the converged model each)."),
        iterations=840,  # two epochs of the 54,000 training images
        variants={"explicit": StudyVariant("shallow", "shallow"), "explicit_deep": StudyVariant("deep", "deep"),
                  "deq": StudyVariant("deq", "deq"), "deq_implicit": StudyVariant("deq", "deq_implicit", IMPLICIT),
                  "deq_reference": StudyVariant("reference", "deq_reference")},
        metrics=(Metric("bits_per_dim", "test bits/dim", False),
                 Metric("log_likelihood", "test log-lik. (nats)", True), Metric("exact_sm", "test exact SM", False)),
        context=("NICE trained by maximum likelihood to convergence is reported at about 4.36 bits/dim on MNIST; "
                 "these runs train by SSM for two epochs at budget 1 (a fraction of one at smaller budgets), so "
                 "their bits/dim lie far above it."),
    ),
    "dkef": Study(
        title="DKEF on UCI data",
        setting=("RedWine, WhiteWine and Parkinsons (whitened with a transform fitted on the training rows; the "
                 "log-likelihood is in the data's own units, the whitening's Jacobian added), 200 centres, features "
                 "of width 30, SSM-VR, Adam at each row's learning rate, batch 200; the model evaluated is the "
                 "family's final one (best validation weights, alpha on the whole training set, log lambda "
                 "fine-tuned). log Z by importance sampling from a defensive mixture proposal (half the broad "
                 "Gaussian N(0, 4 I), half Gaussians at the training points); its effective sample size is reported, "
                 "and a figure resting on fewer than 100 effective draws is marked unreliable."),
        iterations=1000,
        variants={"explicit": StudyVariant("shallow", "shallow"), "explicit_deep": StudyVariant("deep", "deep"),
                  "deq": StudyVariant("deq", "deq"),
                  "deq_faithful": StudyVariant("deq", "deq_faithful", (f"{NET}.deq.init_args.phantom_steps=12",)),
                  "deq_implicit": StudyVariant("deq", "deq_implicit", IMPLICIT),
                  "deq_reference": StudyVariant("reference", "deq_reference")},
        metrics=(Metric("log_likelihood", "test log-lik. (nats / point)", True),
                 Metric("exact_sm", "test exact SM", False), Metric("log_z_ess", "ESS of log Z", True)),
        choices={"log_z_proposal": LOG_Z_PROPOSALS},
        groups={name: (f"--data.init_args.dataset={name}", f"--data.init_args.root={UCI}")
                for name in ("redwine", "whitewine", "parkinsons")},
    ),
    "ncsn": Study(
        title="NCSN on MNIST",
        setting=("MNIST pixels in [0, 1], annealed DSM over 10 noise levels (1 to 0.01), batch 64, Adam; the "
                 "network's width, the learning rate and the sampler's steps as the protocol's fit options set them; "
                 "samples by annealed Langevin dynamics with the sampler and weights (trained or their EMA) the "
                 "protocol fixes; the learning curve is that of the scored weights. KID (the mean over 100 subsets; "
                 "the arm table's ± is over seeds; a unit that records `kid_se`, its own standard error over 5 "
                 "disjoint sample blocks, shows it in the per-run table) and FID@N of the same N samples against the "
                 "Inception features of the first MNIST training images; the untrained row is the DEQ network at "
                 "initialisation, through the same sampling and scoring. Where the protocol asks for it, the held-out"
                 " denoising loss: every MNIST test image at every noise level, noise fixed by the test batch, the "
                 "training weighting, the scored weights (train.py test with test_every_level).")
        + BEFORE_TRAINED_WEIGHTS_FIX,
        iterations=600,
        variants={"explicit": StudyVariant("shallow", "shallow"), "ncsnv2": StudyVariant("deep", "deep"),
                  "deq": StudyVariant("deq", "deq"),
                  "deq_reference": StudyVariant("deq", "deq_reference", (f"{NET}.body=deq_full",)),
                  "untrained": StudyVariant("deq", "untrained", trained=False)},
        metrics=(Metric("dsm_every_level", "held-out DSM loss (every level)", False), Metric("kid", "KID", False),
                 Metric("fid", "FID@N", False)),
        choices={"weights": ("trained", "averaged")},
    ),
    "edm": Study(
        title="EDM denoisers on MNIST",
        setting=("MNIST pixels mapped to [-1, 1], EDM's preconditioning and loss weighting, ln sigma ~ N(-1.2, "
                 "1.2^2), batch 64, Adam; an explicit U-Net middle or a DEQ middle. The held-out denoising loss: "
                 "the training loss on the MNIST test images with fixed draws of sigma and noise (train.py test). "
                 "Samples by the deterministic Heun sampler (18 steps, 35 evaluations) from the weights the protocol "
                 "scores; KID and FID@N as for NCSN; the untrained row is the DEQ network at initialisation, through "
                 "the same sampling and scoring.") + BEFORE_TRAINED_WEIGHTS_FIX,
        iterations=2000,
        variants={"explicit": StudyVariant("shallow", "shallow"), "deq": StudyVariant("deq", "deq"),
                  "untrained": StudyVariant("deq", "untrained", trained=False)},
        metrics=(Metric("loss", "held-out denoising loss", False), Metric("kid", "KID", False),
                 Metric("fid", "FID@N", False)),
        choices={"weights": ("trained", "averaged")},
    ),
    "vae": Study(
        title="VAE with an implicit encoder on MNIST",
        setting=("Dynamically binarised MNIST, MLP encoder and decoder (784-256-256, z 8), RMSprop, batch 128 "
                 "(the encoder and decoder at 1e-3, the score network at each row's learning rate); the implicit "
                 "encoder's entropy gradient from a score network (explicit MLP, deep explicit MLP, or the DEQ) "
                 "trained by SSM-VR with 2 score steps per encoder/decoder step, so an iteration "
                 "is 3 optimiser steps (the Gaussian VAE: 1). Test log-likelihood by AIS (HMC, 10 leapfrog steps) "
                 "on the first test images; the Gaussian VAE's ELBO on all 10,000."),
        iterations=6000,
        variants={"explicit": StudyVariant("shallow", "shallow", steps_per_iteration=3),
                  "explicit_deep": StudyVariant("deep", "deep", steps_per_iteration=3),
                  "deq": StudyVariant("deq", "deq", steps_per_iteration=3),
                  # 3 phantom steps: 0.195 ** 3 < 1 %, the contraction of the trained DEQ (protocol v3)
                  "deq_faithful": StudyVariant("deq", "deq_faithful", (f"{NET}.deq.init_args.phantom_steps=3",),
                                               steps_per_iteration=3),
                  "deq_implicit": StudyVariant("deq", "deq_implicit", IMPLICIT, steps_per_iteration=3),
                  "gaussian": StudyVariant("classical", "classical", config="gaussian_mnist.yaml")},
        metrics=(Metric("ais_log_likelihood", "test AIS log-lik. (nats)", True),
                 Metric("elbo", "test ELBO (nats)", True)),
    ),
}


def depth_entries() -> dict[str, Depth]:
    """Every declared family's depth entries, by entry name, in the declarations' order."""
    return {key: entry for name in declarations() for key, entry in DEPTHS.get(name, {}).items()}


def study_entries() -> dict[str, tuple[Declaration, Study]]:
    """Every declared family with a study entry: its declaration and the entry, by family name, in the
    declarations' order (the order of the report's tables)."""
    return {name: (declared, STUDIES[name]) for name, declared in declarations().items() if name in STUDIES}
