"""NCSN's test fixtures (the family is declared in deqscore/families/ncsn.py)."""

from deqscore.families import net_options

from . import MNIST_SUBSETS, MNIST_WORKERS, NET, STUDY_MNIST

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

    from deqscore.lightning.ncsn import NCSNModule
    from deqscore.models import NCSN

    net = NCSN(dim=16, channels=1, ngf=4, body="deq", deq=deq)
    module = NCSNModule(net, loss="annealed_ssm_vr", sigma_max=1.0, sigma_min=0.1, n_levels=3).double()
    x = torch.rand(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return module, lambda: module.compute_loss(x)


#: the study test's (study options, fit options)
STUDY_TINY = (("--seeds", "0", "--set", "samples=4", "--set", "reference=6"),
              (f"{NET}.ngf=4", "--model.init_args.n_levels=3", f"{SAMPLER}.n_steps_each=1",
               "--data.init_args.batch_size=8", "--data.init_args.num_workers=0", *STUDY_MNIST))
