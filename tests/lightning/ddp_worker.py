"""Two SGD steps of a small DEQ-NICE with the (deterministic) exact SM loss, on 1 process or under DDP.

    python ddp_worker.py OUT.pt DEVICES

Run by tests/lightning/test_ddp.py in a subprocess, since the ddp strategy relaunches the command per rank.
The model carries a parameter that does not affect the score (like an energy's output bias): DDP must
neither hang on it nor reduce it wrongly.
"""

import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from deqscore.lightning import NICEModule, build_module

GLOBAL_BATCH = 8


class NICEWithUnusedBias(NICEModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.energy_bias = torch.nn.Parameter(torch.zeros(1))  # shifts log p, so it has no score

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(out: str, devices: int) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(GLOBAL_BATCH, 8))
    deq = {"class_path": "deqscore.deq.DEQ", "init_args": {"solver": "anderson", "tol": 1e-9, "max_iter": 200}}
    net = {"dim": 8, "n_couplings": 2, "m_net": "deq", "hidden": 8, "deq": deq}
    model = build_module({"class_path": f"{__name__}.NICEWithUnusedBias", "init_args": {
        "net": {"class_path": "deqscore.models.NICE", "init_args": net}, "loss": "exact", "exact_sm_batches": 0}})
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        inference_mode=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // devices, shuffle=False)
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        torch.save({"init": init, "final": final}, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
