"""NICE: an energy given by a normalising flow whose coupling networks (m-nets) may be DEQs."""

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
    args = [f"{NET}.hidden", "12", f"{NET}.n_layers", "3", f"{NET}.n_couplings", "2",
            "--model.init_args.exact_sm_samples", "4", *MNIST_SUBSETS]
    if net_options(config).get("deq"):
        args += [f"{NET}.deq.init_args.max_iter", "40", f"{NET}.deq.init_args.tol", "1e-5"]
    return args


def phantom_probe(deq):
    import torch

    from ..lightning.nice import NICEModule
    from ..models import NICE

    module = NICEModule(NICE(dim=4, n_couplings=2, m_net="deq", hidden=5, deq=deq), loss="ssm").double()
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return module, lambda: module.compute_loss(x)


DECLARATION = Declaration(
    name="nice",
    module="deqscore.lightning.NICEModule",
    configs={"shallow": "explicit.yaml", "deep": "explicit_deep.yaml", "deq": "deq.yaml",
             "reference": "deq_reference.yaml"},
    extra_configs=("configs/demo.yaml",),
    tiny=tiny,
    phantom_probe=phantom_probe,
    depth={"nice": Depth(
        "NICE m-net", "configs/nice/deq.yaml",
        {"full": {"net.dim": 784}, "quick": {"net.dim": 16, "net.hidden": 16, "net.n_couplings": 2}},
        {"full": 128, "quick": 8}, inputs="gaussian",
        train_args={"full": ["--trainer.max_steps", "300", *MNIST_WORKERS],
                    "quick": ["--trainer.max_steps", "2", f"{NET}.hidden", "16", "--model.init_args.exact_sm_samples",
                              "4", *TINY_MNIST]},
    )},
    study=Study(
        title="NICE on MNIST",
        setting=("MNIST with the `logit_squeeze` transform (invertible: exact bits/dim), batch 128, sliced score "
                 "matching, Adam 1e-4, the paper's sizes (4 couplings of width 1000; the reference design: 2). Test "
                 "log-likelihood and bits/dim on the 10,000 test images; test exact SM on the first test images "
                 "(784 backward passes through the converged model each)."),
        iterations=840,  # two epochs of the 54,000 training images
        variants={"explicit": StudyVariant("shallow", "shallow"), "explicit_deep": StudyVariant("deep", "deep"),
                  "deq": StudyVariant("deq", "deq"), "deq_reference": StudyVariant("reference", "deq_reference")},
        metrics=(Metric("bits_per_dim", "test bits/dim", False),
                 Metric("log_likelihood", "test log-lik. (nats)", True), Metric("exact_sm", "test exact SM", False)),
        context=("NICE trained by maximum likelihood to convergence is reported at about 4.36 bits/dim on MNIST; "
                 "these runs train by SSM for two epochs at budget 1 (a fraction of one at smaller budgets), so "
                 "their bits/dim lie far above it."),
        tiny=(("--seeds", "0,1", "--set", "exact_sm_images=4"),
              (f"{NET}.hidden=12", f"{NET}.n_layers=3", f"{NET}.n_couplings=2", "--data.init_args.batch_size=16",
               *STUDY_MNIST)),
    ),
)
