"""Sample grids drawn during training use the weights validation uses (the averaged ones under EMA)."""

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EMAWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deqscore.lightning import SampleGrid, ScoreModule
from deqscore.lightning import callbacks as callbacks_module


class DriftingMean(ScoreModule):
    """A 1-d Gaussian energy whose mean drifts under training; its "samples" are images of the mean itself."""

    def __init__(self):
        super().__init__()
        self.mu = nn.Parameter(torch.zeros(1))

    def compute_loss(self, x):
        return (x - self.mu).pow(2).sum(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)

    def sample_images(self, n):
        return self.mu.detach().expand(n, 1, 2, 2).clone()


def test_per_epoch_grids_are_drawn_from_the_averaged_weights(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(callbacks_module, "save_image_grid", lambda images, path: drawn.append(images[0, 0, 0, 0]))
    module = DriftingMean()
    ema = EMAWeightAveraging(decay=0.5)
    trainer = pl.Trainer(max_epochs=2, callbacks=[ema, SampleGrid(n_samples=2, every_n_epochs=1)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, inference_mode=False, accelerator="cpu")
    data = DataLoader(TensorDataset(torch.full((8, 1), 3.0)), batch_size=4)
    raw_after_epoch = []
    monkeypatch.setattr(DriftingMean, "on_train_epoch_end", lambda self: raw_after_epoch.append(float(self.mu)))
    trainer.fit(module, data)
    # the raw mean moves 0.4 (3 - mu) per step towards 3; the average lags behind it (raw weights would match it)
    assert len(drawn) == 3
    for grid, raw in zip(drawn[:2], raw_after_epoch, strict=True):
        assert 0 < float(grid) < raw - 0.1
    # fit's end copies the average into the module, and the final grid is drawn from it: the last epoch's average
    assert float(drawn[2]) == float(drawn[1]) == float(module.mu.detach())


def test_after_fit_lightnings_averaging_saves_the_average_as_the_trained_weights_and_deqscores_keeps_them(tmp_path):
    """The two averaging callbacks on the same fit: a checkpoint saved once fit has returned."""
    from deqscore.lightning import EMAWeightAveraging as KeepsTrained

    saved = {}
    for name, averaging in (("lightning", EMAWeightAveraging(decay=0.5)), ("deqscore", KeepsTrained(decay=0.5))):
        module = DriftingMean()
        trained = []
        trainer = pl.Trainer(max_epochs=2, callbacks=[averaging], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                             default_root_dir=tmp_path)
        module.on_train_batch_end = lambda *args, m=module, t=trained: t.append(float(m.mu))
        trainer.fit(module, DataLoader(TensorDataset(torch.full((8, 1), 3.0)), batch_size=4))
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
        saved[name] = torch.load(tmp_path / f"{name}.ckpt", weights_only=True), trained[-1]
    (lightning, _), (deqscore, last_step) = saved["lightning"], saved["deqscore"]
    assert float(lightning["current_model_state"]["mu"]) == float(lightning["state_dict"]["mu"]) < last_step - 0.1
    assert float(deqscore["current_model_state"]["mu"]) == last_step
    assert float(deqscore["state_dict"]["mu"]) == float(lightning["state_dict"]["mu"])
