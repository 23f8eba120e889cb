"""DKEF's test fixtures (the family is declared in deqscore/families/dkef.py)."""

from deqscore.families import ROOT, net_options

from . import NET

UCI = str(ROOT / "datasets" / "uci")  # the UCI files shipped with the project


def tiny(config: dict, images) -> list[str]:
    args = [f"{NET}.n_centres", "8", f"{NET}.hidden", "6", "--model.init_args.alpha_points", "40",
            "--model.init_args.log_z_samples", "2000", "--model.init_args.final_log_z_samples", "2000",
            "--model.init_args.log_z_chunk", "500", "--model.init_args.final_lambda_steps", "2",
            "--model.init_args.exact_sm_batches", "1", "--data.init_args.root", UCI,
            "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2"]
    if net_options(config).get("deep_layers"):
        args += [f"{NET}.deep_layers", "4"]
    return args


def phantom_probe(deq):
    import torch

    from deqscore.lightning.dkef import DKEFModule
    from deqscore.models import DKEF

    net = DKEF(dim=2, n_centres=4, hidden=4, feature_net="deq", deq=deq, bandwidth_init="fixed").double()
    x = torch.randn(12, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # centres away from the data: at a data point equal to a centre the kernel's clamped squared distance has a kink
    net.init_centres(torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    module = DKEFModule(net, loss="ssm_vr").train()  # training: alpha solved on one half, the loss on the other
    return module, lambda: module.compute_loss(x)


#: the study test's (study options, fit options)
STUDY_TINY = (("--seeds", "0", "--groups", "redwine", "--set", "log_z_samples=2000"),
              (f"{NET}.n_centres=8", f"{NET}.hidden=6", f"{NET}.deep_layers=4", "--model.init_args.alpha_points=40",
               "--model.init_args.log_z_samples=2000", "--model.init_args.log_z_chunk=500",
               "--model.init_args.final_lambda_steps=2", "--model.init_args.exact_sm_batches=1"))
