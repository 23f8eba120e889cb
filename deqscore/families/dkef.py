"""DKEF: deep kernel exponential families on UCI data, with explicit or DEQ feature networks."""

from ..lightning.dkef import LOG_Z_PROPOSALS
from . import NET, ROOT, Declaration, Depth, Metric, Study, StudyVariant, net_options

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

    from ..lightning.dkef import DKEFModule
    from ..models import DKEF

    net = DKEF(dim=2, n_centres=4, hidden=4, feature_net="deq", deq=deq, bandwidth_init="fixed").double()
    x = torch.randn(12, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # centres away from the data: at a data point equal to a centre the kernel's clamped squared distance has a kink
    net.init_centres(torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    module = DKEFModule(net, loss="ssm_vr").train()  # training: alpha solved on one half, the loss on the other
    return module, lambda: module.compute_loss(x)


DECLARATION = Declaration(
    name="dkef",
    module="deqscore.lightning.DKEFModule",
    configs={"shallow": "explicit_shallow.yaml", "deep": "explicit_deep.yaml", "deq": "deq.yaml",
             "reference": "deq_reference.yaml"},
    tiny=tiny,
    phantom_probe=phantom_probe,
    depth={"dkef": Depth(
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
    study=Study(
        title="DKEF on UCI data",
        setting=("RedWine, WhiteWine and Parkinsons (whitened with a transform fitted on the training rows; the "
                 "log-likelihood is in the data's own units, the whitening's Jacobian added), 200 centres, features "
                 "of width 30, SSM-VR, Adam 1e-2, batch 200; the model evaluated is the family's final one (best "
                 "validation weights, alpha on the whole training set, log lambda fine-tuned). log Z by importance "
                 "sampling from a defensive mixture proposal (half the broad Gaussian N(0, 4 I), half Gaussians at "
                 "the training points); its effective sample size is reported, and a figure resting on fewer than "
                 "100 effective draws is marked unreliable."),
        iterations=1000,
        variants={"explicit": StudyVariant("shallow", "shallow"), "explicit_deep": StudyVariant("deep", "deep"),
                  "deq": StudyVariant("deq", "deq"),
                  "deq_faithful": StudyVariant("deq", "deq_faithful", (f"{NET}.deq.init_args.phantom_steps=12",)),
                  "deq_reference": StudyVariant("reference", "deq_reference")},
        metrics=(Metric("log_likelihood", "test log-lik. (nats / point)", True),
                 Metric("exact_sm", "test exact SM", False), Metric("log_z_ess", "ESS of log Z", True)),
        choices={"log_z_proposal": LOG_Z_PROPOSALS},
        groups={name: (f"--data.init_args.dataset={name}", f"--data.init_args.root={UCI}")
                for name in ("redwine", "whitewine", "parkinsons")},
        tiny=(("--seeds", "0", "--groups", "redwine", "--set", "log_z_samples=2000"),
              (f"{NET}.n_centres=8", f"{NET}.hidden=6", f"{NET}.deep_layers=4", "--model.init_args.alpha_points=40",
               "--model.init_args.log_z_samples=2000", "--model.init_args.log_z_chunk=500",
               "--model.init_args.final_lambda_steps=2", "--model.init_args.exact_sm_batches=1")),
    ),
)
