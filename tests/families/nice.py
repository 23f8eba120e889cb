"""NICE's test fixtures (the family is declared in deqscore/families/nice.py)."""

from deqscore.families import net_options

from . import MNIST_SUBSETS, NET, STUDY_MNIST


def tiny(config: dict, images) -> list[str]:
    args = [f"{NET}.hidden", "12", f"{NET}.n_layers", "3", f"{NET}.n_couplings", "2",
            "--model.init_args.exact_sm_samples", "4", *MNIST_SUBSETS]
    if net_options(config).get("deq"):
        args += [f"{NET}.deq.init_args.max_iter", "40", f"{NET}.deq.init_args.tol", "1e-5"]
    return args


def phantom_probe(deq):
    import torch

    from deqscore.lightning.nice import NICEModule
    from deqscore.models import NICE

    module = NICEModule(NICE(dim=4, n_couplings=2, m_net="deq", hidden=5, deq=deq), loss="ssm").double()
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return module, lambda: module.compute_loss(x)


#: the study test's (study options, fit options)
STUDY_TINY = (("--seeds", "0", "--set", "exact_sm_images=4"),
              (f"{NET}.hidden=12", f"{NET}.n_layers=3", f"{NET}.n_couplings=2", "--data.init_args.batch_size=16",
               *STUDY_MNIST))
