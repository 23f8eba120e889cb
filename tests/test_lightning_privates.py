"""The private parts of Lightning and torch.utils.data that deqscore relies on (all of them in
:mod:`deqscore.privates`), each checked here by what the library needs it to do, so that a release that changes
one fails this file, naming it, rather than changing a run silently. The fits are tiny: two linear layers, 8
items in batches of 2 (4 batches an epoch), each batch stepping two optimisers, so that Lightning's
``global_step`` (optimizer steps) and its count of batches that stepped differ."""

import ast
import csv
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringDataModule, BoringModel
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from deqscore import privates

BATCHES = 4  # an epoch's


class TwoOptimizers(pl.LightningModule):
    """Records, per training batch, (epoch, batch index, batches that stepped before it, whether it is the epoch's
    last), and the epochs whose end hooks ran."""

    def __init__(self) -> None:
        super().__init__()
        self.nets = nn.ModuleList([nn.Linear(2, 1), nn.Linear(2, 1)])
        self.automatic_optimization = False
        self.seen: list[tuple[int, int, int]] = []
        self.last_batch: list[bool] = []
        self.ends: list[int] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch_idx, privates.batches_that_stepped(self.trainer)))
        for optimizer, net in zip(self.optimizers(), self.nets, strict=True):
            optimizer.zero_grad()
            self.manual_backward(net(batch[0]).pow(2).mean())
            optimizer.step()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.last_batch.append(privates.at_last_batch_of_epoch(self.trainer))

    def on_train_epoch_end(self):
        self.ends.append(self.current_epoch)

    def configure_optimizers(self):
        return [torch.optim.SGD(net.parameters(), lr=0.1) for net in self.nets]

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(2 * BATCHES, 2)), batch_size=2)


class Resume(pl.Callback):
    """What ResumeFixes does with the loop state (:mod:`deqscore.lightning.run_hooks`), and its ``last.ckpt`` at the
    end of training; with ``rewrite=False``, Lightning's own resume."""

    def __init__(self, rewrite: bool = True) -> None:
        self.rewrite, self.after_epoch = rewrite, False

    def on_load_checkpoint(self, trainer, module, checkpoint):
        if self.rewrite:
            self.after_epoch = privates.complete_finished_epoch(checkpoint)
            privates.reopen_cut_epoch(checkpoint)

    def on_train_epoch_start(self, trainer, module):
        if self.after_epoch:
            privates.start_epoch_afresh(trainer)
            self.after_epoch = False

    def on_train_end(self, trainer, module):
        privates.save_last_checkpoint(trainer.checkpoint_callback, trainer)


class SaveAtFirstEpochEnd(pl.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def fit(module, root, max_steps, ckpt_path=None, callbacks=()):
    trainer = pl.Trainer(
        max_steps=max_steps, default_root_dir=root, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", save_top_k=-1, every_n_train_steps=10, save_last=True),
                   *callbacks])
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """6 batches (12 optimizer steps): epoch 0 whole (checkpointed in its end hooks, at step 8) and 2 batches of
    epoch 1, where max_steps cuts it; ModelCheckpoint saves at step 10, in the end hooks of epoch 1's first batch."""
    root = tmp_path_factory.mktemp("run")
    module = TwoOptimizers()
    fit(module, root, 12, callbacks=[Resume(), SaveAtFirstEpochEnd(root / "epoch_end.ckpt")])
    return root, module


def load(path):
    return torch.load(path, weights_only=False)


def test_batches_that_stepped_counts_batches_not_optimizer_steps(first_run):
    root, module = first_run
    assert [s[2] for s in module.seen] == list(range(6))
    assert privates.checkpoint_batches_that_stepped(load(root / "epoch_end.ckpt")) == 4
    last = load(root / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 12 and privates.checkpoint_batches_that_stepped(last) == 6


def test_the_last_batch_of_an_epoch_is_told(first_run):
    assert first_run[1].last_batch == [False, False, False, True, False, False]


def test_a_checkpoint_saved_in_a_batchs_end_hooks_is_told_from_one_saved_at_the_epochs_end(first_run):
    root = first_run[0]
    assert privates.saved_at_batch_end(load(root / "checkpoints" / "epoch=1-step=10.ckpt"))
    assert not privates.saved_at_batch_end(load(root / "epoch_end.ckpt"))


def test_model_checkpoint_saves_last_at_the_present_step(first_run):
    # without it, last.ckpt would hold step 10: Lightning saved it there and does not again at the end
    assert load(first_run[0] / "checkpoints" / "last.ckpt")["global_step"] == 12


@pytest.mark.parametrize("rewrite", [True, False])
def test_a_resume_after_a_finished_epoch_starts_the_next_epoch_once(first_run, tmp_path, rewrite):
    ckpt = first_run[0] / "epoch_end.ckpt"
    assert privates.complete_finished_epoch(load(ckpt))
    module = TwoOptimizers()
    fit(module, tmp_path, 16, ckpt_path=ckpt, callbacks=[Resume(rewrite)])
    trained = [(epoch, batch) for epoch, batch, _ in module.seen]
    if rewrite:
        assert trained == [(1, b) for b in range(BATCHES)] and module.ends == [1]
    else:  # Lightning's own resume replays epoch 0's end: what the rewrite is for
        assert module.ends[0] == 0


@pytest.mark.parametrize("rewrite", [True, False])
def test_a_resume_of_an_epoch_cut_by_max_steps_continues_that_epoch(first_run, tmp_path, rewrite):
    ckpt = first_run[0] / "checkpoints" / "last.ckpt"
    assert privates.reopen_cut_epoch(load(ckpt)) and not privates.complete_finished_epoch(load(ckpt))
    module = TwoOptimizers()
    fit(module, tmp_path, 16, ckpt_path=ckpt, callbacks=[Resume(rewrite)])
    trained = [(epoch, batch) for epoch, batch, _ in module.seen]
    if rewrite:
        assert trained == [(1, 2), (1, 3)] and module.ends == [1]
    else:  # Lightning's own resume counts the cut epoch done and starts the next: what the rewrite is for
        assert trained[0][0] == 2


def test_checkpoint_states_of_a_moved_run_directory_are_carried_over(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    state = ModelCheckpoint(dirpath=old).state_dict() | {"best_model_path": str(old / "best.ckpt"),
                                                         "last_model_path": str(old / "last.ckpt"),
                                                         "best_k_models": {str(old / "best.ckpt"): 0.5}}
    assert {"dirpath", "best_model_path", "kth_best_model_path", "last_model_path", "best_k_models"} <= set(state)
    moved = ModelCheckpoint(dirpath=new)
    checkpoint = {"callbacks": {moved.state_key: dict(state)}}
    privates.relocate_checkpoint_states(SimpleNamespace(ckpt_path=str(new / "last.ckpt"),
                                                        checkpoint_callbacks=[moved]), checkpoint)
    moved.load_state_dict(checkpoint["callbacks"][moved.state_key])
    assert moved.best_model_path == str(new / "best.ckpt") and moved.last_model_path == str(new / "last.ckpt")
    assert moved.best_k_models == {str(new / "best.ckpt"): 0.5}
    unmoved = ModelCheckpoint(dirpath=new)
    with pytest.warns(UserWarning):  # what Lightning does with the state of another folder: drops most of it
        unmoved.load_state_dict(dict(state))
    assert unmoved.last_model_path == "" and unmoved.best_k_models == {}


def test_ddp_process_group_is_made_with_the_timeout_set(monkeypatch):
    import pytorch_lightning.strategies.ddp as ddp

    made = {}
    monkeypatch.setattr(ddp, "_init_dist_connection", lambda *args, **kwargs: made.update(kwargs))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), logger=False)
    privates.set_process_group_timeout(trainer.strategy, 7.0)
    trainer.strategy.setup_distributed()
    assert made["timeout"] == timedelta(seconds=7)


def test_ddp_strategy_tells_whether_it_finds_unused_parameters():
    assert privates.finds_unused_parameters(DDPStrategy(find_unused_parameters=True))
    assert not privates.finds_unused_parameters(DDPStrategy())
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ddp_find_unused_parameters_true", logger=False)
    assert privates.finds_unused_parameters(trainer.strategy)


def test_the_attached_trainer_or_none():
    module = BoringModel()
    assert privates.attached_trainer(module) is None
    trainer = pl.Trainer(logger=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    assert privates.attached_trainer(module) is trainer


def test_the_csv_logger_continues_an_existing_log(tmp_path):
    for step, row in enumerate([{"a": 1.0}, {"a": 2.0, "b": 3.0}]):
        logger = privates.AppendingCSVLogger(tmp_path, name="run", version="")
        logger.log_metrics(row, step=step)
        logger.finalize("success")
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["a"], r.get("b", "")) for r in rows] == [("0", "1.0", ""), ("1", "2.0", "3.0")]


class Recorded(BoringModel):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_lightning_cli_records_the_class_and_instantiator_in_hyperparameters():
    cli = privates.LightningCLIHooks(BoringModel, BoringDataModule, subclass_mode_model=True, run=False,
                                     args=["--model", f"{__name__}.Recorded", "--model.init_args.width", "5"],
                                     trainer_defaults={"logger": False})
    hparams = dict(cli.model.hparams)
    assert hparams[privates.CLASS_PATH_KEY].endswith("Recorded") and privates.INSTANTIATOR_KEY in hparams
    assert hparams["width"] == 5
    with privates.recording_hyperparameters({privates.CLASS_PATH_KEY: "x.Recorded", "width": 4}, "x.build"):
        module = Recorded(width=4)
    assert dict(module.hparams) == {privates.CLASS_PATH_KEY: "x.Recorded", "width": 4,
                                    privates.INSTANTIATOR_KEY: "x.build"}


def test_lightning_cli_runs_its_steps_through_the_public_hooks(tmp_path):
    calls = []

    class Hooked(privates.LightningCLIHooks):
        def read_ckpt_path(self):
            calls.append("read_ckpt_path")
            super().read_ckpt_path()

        def add_configure_optimizers(self, subcommand):
            calls.append(f"add_configure_optimizers {subcommand}")
            super().add_configure_optimizers(subcommand)

        def run_subcommand(self, subcommand):
            calls.append(f"run_subcommand {subcommand}")
            super().run_subcommand(subcommand)

    cli = Hooked(BoringModel, BoringDataModule, args=[
        "fit", "--trainer.fast_dev_run", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path), "--optimizer", "SGD", "--optimizer.lr", "0.1"])
    assert calls == ["read_ckpt_path", "add_configure_optimizers fit", "run_subcommand fit"]
    assert cli.trainer.state.finished and isinstance(cli.model.configure_optimizers(), torch.optim.SGD)


class Reversed(privates.IndexSamplerLoader):
    def index_sampler(self):
        return list(reversed(list(privates.loader_index_sampler(self))))


def test_a_loader_draws_its_indices_from_its_index_sampler():
    data = TensorDataset(torch.arange(6))
    plain = DataLoader(data, batch_size=2)
    assert isinstance(privates.loader_index_sampler(plain), BatchSampler)
    assert isinstance(privates.loader_index_sampler(DataLoader(data, batch_size=None)), SequentialSampler)
    loader = Reversed(data, batch_size=2)
    assert [b[0].tolist() for b in loader] == [[4, 5], [2, 3], [0, 1]] and len(loader) == 3


def _defined_names(path):
    """The names ``path`` defines: its functions and classes, and the attributes it assigns."""
    tree = ast.parse(path.read_text())
    names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    return names | {t.attr for node in ast.walk(tree) for t in getattr(node, "targets", [getattr(node, "target", None)])
                    if isinstance(t, ast.Attribute)}


def _private_uses(path, own):
    """``path``'s uses of another library's private: an underscore attribute of anything but the package's own
    objects, an underscore attribute of ``self`` that no module of the package defines (one a base class from
    another library brings), and an underscore name or module imported from Lightning, jsonargparse or
    torch.utils.data. ``own``: the names the package defines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") or (
                isinstance(node.value, ast.Attribute) and node.value.attr in own)
            if not (mine and node.attr in own):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
        if module.split(".")[0] in ("pytorch_lightning", "lightning_fabric", "jsonargparse") or module.startswith(
                "torch.utils.data"):
            if "._" in f".{module}" or any(a.name.startswith("_") for a in node.names):
                found.append(f"{path.name}:{node.lineno}: from {module} import ...")
    return sorted(found)


#: torch's own privates outside torch.utils.data, which this module does not cover: nn.Module._apply (the hook
#: every ``.to()`` goes through), and in the implicit backward (deq/implicit.py) the legacy-vmap batch dimensions and
#: the engine's plan (whether a backward will use a gradient edge; unreadable, every partial is computed: still exact)
TORCH_PRIVATES = {"ncsn.py": {"._apply"}, "implicit.py": {"._C", "._vmapmode_increment_nesting",
                                                          "._vmapmode_decrement_nesting", "._remove_batch_dim",
                                                          "._add_batch_dim", "._will_engine_execute_node"}}


def test_no_module_but_privates_uses_another_librarys_private():
    package = Path(privates.__file__).parent
    paths = sorted(package.rglob("*.py"))
    own = set().union(*map(_defined_names, paths))
    found = [use for path in paths if path.name != "privates.py" for use in _private_uses(path, own)
             if use.split(": ", 1)[1] not in TORCH_PRIVATES.get(path.name, ())]
    assert not found, "Lightning/jsonargparse/DataLoader privates outside deqscore/privates.py:\n" + "\n".join(found)


def test_the_private_use_scan_sees_each_kind(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from pytorch_lightning.core.mixins.hparams_mixin import _given\n"
                     "class A:\n    def f(self, trainer):\n        self._mine = 1\n        return self._mine, "
                     "trainer.fit_loop._x, self._trainer\n")
    assert _private_uses(probe, _defined_names(probe)) == [
        "probe.py:1: from pytorch_lightning.core.mixins.hparams_mixin import ...", "probe.py:5: ._trainer",
        "probe.py:5: ._x"]
