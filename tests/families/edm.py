"""EDM's test fixtures (the family is declared in deqscore/families/edm.py)."""

from deqscore.families import net_options

from . import MNIST_SUBSETS, MNIST_WORKERS, NET, STUDY_MNIST

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

    from deqscore.lightning.edm import EDMModule
    from deqscore.models.edm import EDM

    net = EDM(dim=16, channels=1, ngf=4, body="deq", deq=deq)
    module = EDMModule(net).double()
    x = torch.rand(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return module, lambda: module.compute_loss(x)


#: the study test's (study options, fit options)
STUDY_TINY = (("--seeds", "0", "--set", "samples=4", "--set", "reference=6"),
              (f"{NET}.ngf=4", f"{SAMPLER}.num_steps=2", "--data.init_args.batch_size=8",
               "--data.init_args.num_workers=0", *STUDY_MNIST))
