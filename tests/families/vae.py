"""The implicit-encoder VAE's test fixtures (the family is declared in deqscore/families/vae.py)."""

from deqscore.families import net_options

from . import MNIST_SUBSETS, MNIST_WORKERS, NET, STUDY_MNIST


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

    from deqscore.models import ImplicitVAE

    net = ImplicitVAE(dim=6, z_dim=2, eps_dim=2, hidden=5, score="deq", deq=deq).double()
    x = torch.bernoulli(torch.full((5, 6), 0.4, dtype=torch.float64), generator=torch.Generator().manual_seed(1))
    return net, lambda: net.score_loss(x).mean()  # SSM-VR of the score network s(x, .)


#: the study test's (study options, fit options)
STUDY_TINY = (("--seeds", "0", "--set", "ais_images=4", "--set", "ais_steps=3", "--set", "ais_chains=2"),
              (f"{NET}.z_dim=3", f"{NET}.hidden=16", "--model.init_args.val_ais_steps=3",
               "--data.init_args.batch_size=16", *STUDY_MNIST))
