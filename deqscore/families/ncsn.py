"""NCSN: noise-conditional score networks (annealed DSM, annealed Langevin sampling) with explicit or DEQ bodies."""

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

SAMPLER = "--model.init_args.sampler.init_args"


def tiny(config: dict, images) -> list[str]:
    args = [f"{NET}.ngf", "4", "--model.init_args.n_levels", "3", f"{SAMPLER}.n_steps_each", "1",
            *MNIST_WORKERS, "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
            "--trainer.val_check_interval", "null", "--trainer.check_val_every_n_epoch", "1",
            "--trainer.max_steps", "-1"]
    if net_options(config).get("deq"):
        args += [f"{NET}.deq.init_args.max_iter", "30", f"{NET}.deq.init_args.tol", "1e-4"]
    if config["data"]["class_path"].rsplit(".", 1)[-1] != "MNISTDataModule":  # a few fake CIFAR-10 / CelebA images
        return [*args, "--data.init_args.data_dir", str(images()), "--data.init_args.use_lmdb", "false"]
    return [*args, *MNIST_SUBSETS]


def phantom_probe(deq):
    import torch

    from ..lightning.ncsn import NCSNModule
    from ..models import NCSN

    net = NCSN(dim=16, channels=1, ngf=4, body="deq", deq=deq)
    module = NCSNModule(net, loss="annealed_ssm_vr", sigma_max=1.0, sigma_min=0.1, n_levels=3).double()
    x = torch.rand(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return module, lambda: module.compute_loss(x)


DECLARATION = Declaration(
    name="ncsn",
    module="deqscore.lightning.NCSNModule",
    configs={"shallow": "explicit_mnist.yaml", "deep": "ncsnv2_mnist.yaml", "deq": "deq_mnist.yaml"},
    tiny=tiny,
    phantom_probe=phantom_probe,
    depth={"ncsn": Depth(
        "NCSN body (MNIST)", "configs/ncsn/deq_mnist.yaml",
        {"full": {"net.dim": 784}, "quick": {"net.dim": 64, "net.ngf": 4, "n_levels": 3}},
        {"full": 8, "quick": 4}, inputs="pixels",
        train_args={"full": ["--trainer.max_steps", "150", "--data.init_args.batch_size", "32", *MNIST_WORKERS],
                    "quick": ["--trainer.max_steps", "2", f"{NET}.ngf", "4", "--model.init_args.n_levels", "3",
                              *TINY_MNIST]},
        # the config trains DSM with IFT; the curves compare phantom steps, the stacks backpropagate directly
        deq_options={"net.deq.backward": "phantom"},
    )},
    study=Study(
        title="NCSN on MNIST",
        setting=("MNIST pixels in [0, 1], annealed DSM over 10 noise levels (1 to 0.01), base width 32, batch 64, "
                 "Adam 1e-3; samples by annealed Langevin dynamics with the sampler and weights (trained or their "
                 "EMA) the protocol fixes; the learning curve is that of the scored weights. KID (mean and standard "
                 "deviation over 100 subsets) and FID@N of the same N samples against the Inception features of "
                 "the first MNIST training images; the untrained row is the DEQ network at initialisation, through "
                 "the same sampling and scoring."),
        iterations=600,
        variants={"explicit": StudyVariant("shallow", "shallow"), "ncsnv2": StudyVariant("deep", "deep"),
                  "deq": StudyVariant("deq", "deq"),
                  "deq_reference": StudyVariant("deq", "deq_reference", (f"{NET}.body=deq_full",)),
                  "untrained": StudyVariant("deq", "untrained", trained=False)},
        metrics=(Metric("kid", "KID", False), Metric("fid", "FID@N", False)),
        choices={"weights": ("trained", "averaged")},
        tiny=(("--seeds", "0", "--set", "samples=4", "--set", "reference=6"),
              (f"{NET}.ngf=4", "--model.init_args.n_levels=3", f"{SAMPLER}.n_steps_each=1",
               "--data.init_args.batch_size=8", "--data.init_args.num_workers=0", *STUDY_MNIST)),
    ),
)
