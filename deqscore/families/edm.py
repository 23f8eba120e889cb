"""EDM: preconditioned denoisers (Karras et al. 2022) with an explicit U-Net or a DEQ middle, Heun sampling."""

from . import MNIST_SUBSETS, MNIST_WORKERS, NET, Declaration, net_options

SAMPLER = "--model.init_args.sampler.init_args"


def tiny(config: dict, images) -> list[str]:
    args = [f"{NET}.ngf", "4", f"{SAMPLER}.num_steps", "2", *MNIST_WORKERS, *MNIST_SUBSETS,
            "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
            "--trainer.val_check_interval", "null", "--trainer.check_val_every_n_epoch", "1",
            "--trainer.max_steps", "-1"]
    if net_options(config).get("deq"):
        args += [f"{NET}.deq.init_args.max_iter", "30", f"{NET}.deq.init_args.tol", "1e-4"]
    return args


def phantom_probe(deq):
    import torch

    from ..lightning.edm import EDMModule
    from ..models.edm import EDM

    net = EDM(dim=16, channels=1, ngf=4, body="deq", deq=deq)
    module = EDMModule(net).double()
    x = torch.rand(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return module, lambda: module.compute_loss(x)


DECLARATION = Declaration(
    name="edm",
    module="deqscore.lightning.edm.EDMModule",
    configs={"shallow": "explicit_mnist.yaml", "deq": "deq_mnist.yaml"},
    tiny=tiny,
    phantom_probe=phantom_probe,
)
