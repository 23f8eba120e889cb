"""The VAE with an implicit encoder, whose entropy gradient comes from a score network (explicit or DEQ)."""

from . import (
    MNIST_SUBSETS,
    MNIST_WORKERS,
    NET,
    STUDY_MNIST,
    TINY_MNIST,
    Declaration,
    Depth,
    Metric,
    Study,
    StudyVariant,
    net_options,
)


def tiny(config: dict, images) -> list[str]:
    init = net_options(config)
    args = [f"{NET}.z_dim", "3", f"{NET}.hidden", "16", "--trainer.limit_train_batches", "3",
            "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "1"]
    if "eps_dim" in init:
        args += [f"{NET}.eps_dim", "3"]
    if init.get("arch") == "conv":
        args += [f"{NET}.nef", "4", "--data.init_args.data_dir", str(images()), *MNIST_WORKERS,
                 "--data.init_args.use_lmdb", "false"]
    else:
        args += [*MNIST_SUBSETS, "--model.init_args.ais_batches", "1",
                 "--model.init_args.ais_steps", "5", "--model.init_args.ais_chains", "2",
                 "--model.init_args.val_ais_steps", "3"]
    if init.get("deq"):
        args += [f"{NET}.deq.init_args.max_iter", "30", f"{NET}.deq.init_args.tol", "1e-4"]
    return args


def phantom_probe(deq):
    import torch

    from ..models import ImplicitVAE

    net = ImplicitVAE(dim=6, z_dim=2, eps_dim=2, hidden=5, score="deq", deq=deq).double()
    x = torch.bernoulli(torch.full((5, 6), 0.4, dtype=torch.float64), generator=torch.Generator().manual_seed(1))
    return net, lambda: net.score_loss(x).mean()  # SSM-VR of the score network s(x, .)


DECLARATION = Declaration(
    name="vae",
    module="deqscore.lightning.VAEModule",
    configs={"shallow": "explicit_mnist.yaml", "deep": "explicit_deep_mnist.yaml", "deq": "deq_mnist.yaml"},
    tiny=tiny,
    phantom_probe=phantom_probe,
    depth={
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
    study=Study(
        title="VAE with an implicit encoder on MNIST",
        setting=("Dynamically binarised MNIST, MLP encoder and decoder (784-256-256, z 8), RMSprop 1e-3, batch "
                 "128; the implicit encoder's entropy gradient from a score network (explicit MLP, deep explicit "
                 "MLP, or the DEQ) trained by SSM-VR with 2 score steps per encoder/decoder step, so an iteration "
                 "is 3 optimiser steps (the Gaussian VAE: 1). Test log-likelihood by AIS (HMC, 10 leapfrog steps) "
                 "on the first test images; the Gaussian VAE's ELBO on all 10,000."),
        iterations=6000,
        variants={"explicit": StudyVariant("shallow", "shallow", steps_per_iteration=3),
                  "explicit_deep": StudyVariant("deep", "deep", steps_per_iteration=3),
                  "deq": StudyVariant("deq", "deq", steps_per_iteration=3),
                  # 3 phantom steps: 0.195 ** 3 < 1 %, the contraction of the trained DEQ (protocol v3)
                  "deq_faithful": StudyVariant("deq", "deq_faithful", (f"{NET}.deq.init_args.phantom_steps=3",),
                                               steps_per_iteration=3),
                  "gaussian": StudyVariant("classical", "classical", config="gaussian_mnist.yaml")},
        metrics=(Metric("ais_log_likelihood", "test AIS log-lik. (nats)", True),
                 Metric("elbo", "test ELBO (nats)", True)),
        tiny=(("--seeds", "0", "--set", "ais_images=4", "--set", "ais_steps=3", "--set", "ais_chains=2"),
              (f"{NET}.z_dim=3", f"{NET}.hidden=16", "--model.init_args.val_ais_steps=3",
               "--data.init_args.batch_size=16", *STUDY_MNIST)),
    ),
)
