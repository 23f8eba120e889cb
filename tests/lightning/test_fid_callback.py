"""FID during training and from sample.py, end to end on a tiny NCSN: the logged FID is the Frechet distance of the
averaged model's seeded samples against the cached training-set statistics, recomputed independently here; the
best-FID checkpoint, the grid, fid.json and the usage errors."""

import functools
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import sample
from deqscore.cli.train import main, run
from deqscore.configfiles import load_config
from deqscore.lightning import load_module
from deqscore.lightning.callbacks import read_metrics_csv
from deqscore.lightning.fid import BEST_FID_FILE, _share
from deqscore.metrics import kernel_inception_distance
from deqscore.metrics.inception import InceptionFeatures
from deqscore.metrics.reference import image_stats, load_stats, stats_file
from deqscore.metrics.statistics import frechet_distance
from tests.test_layering import FLOORS, PACKAGE

from .conftest import tiny_args

pytestmark = pytest.mark.xdist_group("fid_callback")  # one worker runs the module, so its module fixture is built once

CONFIG = "configs/ncsn/explicit_mnist.yaml"
N, REFERENCE, BATCH = 6, 10, 4


def _fid_args(stats_root) -> list[str]:
    return ["--trainer.callbacks+=deqscore.lightning.FIDCallback", "--trainer.callbacks.num_samples", str(N),
            "--trainer.callbacks.reference_images", str(REFERENCE), "--trainer.callbacks.batch_size", str(BATCH),
            "--trainer.callbacks.stats_root", str(stats_root), "--trainer.callbacks.grid_size", "4"]


@pytest.fixture(scope="module")
def fid_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fid")
    main(["fit", *tiny_args(tmp, CONFIG, "r"), "--trainer.max_epochs", "2", *_fid_args(tmp / "stats")])
    return tmp


def test_logged_fid_is_the_distance_of_the_averaged_models_seeded_samples(fid_run):
    logged = read_metrics_csv(fid_run / "r" / "metrics.csv")
    assert [v for _, v in logged["val/fid_samples"]] == [N, N]
    fids = [v for _, v in logged["val/fid"]]
    assert len(fids) == 2 and all(f > 0 for f in fids)
    key = {"dataset": "mnist", "split": "train", "resolution": "28x28", "count": REFERENCE}
    reference = load_stats(stats_file(key, fid_run / "stats"), key)  # cached by the first evaluation
    # epoch 1's FID used the averaged weights that last.ckpt stores, and samples seeded by (seed 0, epoch 1, rank 0)
    module = load_module(fid_run / "r" / "checkpoints" / "last.ckpt").eval()
    torch.manual_seed(0 + 1_000_003 * 1)
    images = torch.cat([module.sample_images(k) for k in (BATCH, N - BATCH)])
    stats = image_stats(images, InceptionFeatures())
    assert frechet_distance(stats, reference) == pytest.approx(fids[1], rel=1e-4)
    # the KID of the same samples' features, logged beside it (the callback and sample.py share one function)
    kid = kernel_inception_distance(stats.features, torch.as_tensor(reference.features), seed=0)
    assert [v for _, v in logged["val/kid"]][1] == pytest.approx(kid["kid"], rel=1e-3, abs=1e-6)
    # the reference is the statistics of the first REFERENCE training images
    from deqscore.data import MNISTDataModule

    raw = MNISTDataModule().raw_images(True)[:REFERENCE]
    np.testing.assert_allclose(reference.mu, image_stats(raw, InceptionFeatures()).mu, rtol=1e-6, atol=1e-8)


def test_best_fid_checkpoint_and_grids(fid_run):
    best = torch.load(fid_run / "r" / "checkpoints" / BEST_FID_FILE, weights_only=True)
    fids = [v for _, v in read_metrics_csv(fid_run / "r" / "metrics.csv")["val/fid"]]
    assert best["epoch"] == int(np.argmin(fids))  # the checkpoint of the lowest FID
    state = next(v for k, v in best["callbacks"].items() if "FIDCallback" in k)
    assert state["best_fid"] == pytest.approx(min(fids))
    assert "current_model_state" in best  # written after validation: trained and averaged weights in place
    assert sorted(p.name for p in (fid_run / "r" / "fid").iterdir()) == ["epoch_0000.png", "epoch_0001.png"]


def test_fid_callback_listed_before_the_averaging_is_refused(tmp_path, capsys):
    args = tiny_args(tmp_path, CONFIG, "order")
    config = load_config(args[1])
    config["trainer"]["callbacks"].insert(0, {"class_path": "deqscore.lightning.FIDCallback"})
    path = tmp_path / "order.yaml"
    path.write_text(yaml.safe_dump(config))
    assert run(["fit", *args[:1], str(path), *args[2:], "--trainer.max_epochs", "1"]) == 2
    assert "list FIDCallback after EMAWeightAveraging" in capsys.readouterr().err
    assert not (tmp_path / "order").exists()  # refused before anything is written


def test_processes_share_the_samples_exactly():
    for n in (7, 8, 1000):
        for world in (1, 2, 3):
            shares = [_share(n, rank, world) for rank in range(world)]
            assert sum(shares) == n and max(shares) - min(shares) <= 1


def test_sample_script_writes_the_fid_of_its_samples(fid_run, tmp_path, capsys):
    ckpt = fid_run / "r" / "checkpoints" / "last.ckpt"
    sample.main(["--checkpoint", str(ckpt), "--num-samples", str(N), "--out", str(tmp_path / "s"), "--fid",
                 "--batch-size", "3", "--stats-root", str(fid_run / "stats"), "--reference-images", str(REFERENCE),
                 "--final-denoise", "off"])
    # the sampling cost: one evaluation per Langevin step (no final denoising step); no DEQ, so no iterations
    module = load_module(ckpt)
    evaluations = len(module.sigmas) * module.sampler.n_steps_each
    printed = capsys.readouterr().out
    assert re.search(rf"^sampling cost: {evaluations} network evaluations per sample$", printed, re.M)
    report = json.loads((tmp_path / "s" / "fid.json").read_text())
    assert report["num_samples"] == N and report["final_denoise"] is False
    assert report["reference"] == f"mnist train ({REFERENCE} images)"
    with np.load(tmp_path / "s" / "samples.npz") as data:
        images = torch.from_numpy(data["samples"])
    key = {"dataset": "mnist", "split": "train", "resolution": "28x28", "count": REFERENCE}
    expected = frechet_distance(image_stats(images, InceptionFeatures()),
                                load_stats(stats_file(key, fid_run / "stats"), key))
    assert report["fid"] == pytest.approx(expected, rel=1e-6)
    assert f"FID {report['fid']:.3f} from {N} samples" in printed
    # KID of the same features, against the reference features the cache keeps (all of them here)
    reference = load_stats(stats_file(key, fid_run / "stats"), key)
    assert report["label"] == f"FID@{N}" and reference.features.shape == (REFERENCE, 2048)
    features = InceptionFeatures()(images)
    kid = kernel_inception_distance(features, torch.as_tensor(reference.features), seed=report["seed"] or 0)
    assert report["kid"] == pytest.approx(kid["kid"], rel=1e-4) and report["kid_subset_size"] == min(N, REFERENCE)


@pytest.mark.parametrize(("extra", "message"), [
    (["--num-samples", "1"], "--fid needs --num-samples >= 2"),
    (["--fid-stats", "missing.npz"], "no FID statistics at missing.npz"),
])
def test_sample_script_fid_usage_errors_write_nothing(fid_run, tmp_path, capsys, extra, message):
    ckpt = fid_run / "r" / "checkpoints" / "last.ckpt"
    argv = ["--checkpoint", str(ckpt), "--out", str(tmp_path / "s"), "--fid", "--num-samples", "4", *extra]
    with pytest.raises(SystemExit) as exit_info:
        sample.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_fid_without_training_images_or_statistics_names_the_missing_files(tmp_path, capsys):
    import argparse
    from types import SimpleNamespace

    from deqscore.cli.fid_job import FIDJob

    args = argparse.Namespace(inception_weights=None, fid_stats=None, data_dir=str(tmp_path / "empty"),
                              reference_images=None, stats_root=str(tmp_path / "stats"), checkpoint="c.ckpt",
                              raw_weights=False, seed=0)
    module = SimpleNamespace(data_source={"class_path": "deqscore.data.CIFAR10DataModule", "data_dir": "datasets"})
    with pytest.raises(SystemExit) as exit_info:
        FIDJob.prepare(args, module, torch.device("cpu"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--fid:" in err and "cifar-10-python.tar.gz" in err
    with pytest.raises(SystemExit):
        FIDJob.prepare(args, SimpleNamespace(data_source=None), torch.device("cpu"))
    assert "records no training images" in capsys.readouterr().err


def _climbs_back(argv: list[str]) -> set[tuple[str, str]]:
    """Run sample.py with ``argv`` and list every call from a lower floor of the package back up into the
    command-line floor, where the arguments are read (a function of the script handed down and called back), as
    (caller, callee). A sampler calling the score network it was given is the model's business, not the
    arguments' walk, and is not counted."""

    @functools.cache  # per code object: the profiler calls this for every Python call of the run
    def place(code):
        try:
            parts = Path(code.co_filename).resolve().relative_to(PACKAGE).parts
        except ValueError:
            return None
        floor = FLOORS.get(parts[0].removesuffix(".py"))  # None: the package's own __init__
        return None if floor is None else (floor, f"{'/'.join(parts)}:{code.co_name}")

    climbs = set()

    def profile(frame, event, arg):
        if event != "call" or (callee := place(frame.f_code)) is None or callee[0] != FLOORS["cli"]:
            return
        caller, where = frame.f_back, None
        while caller is not None and (where := place(caller.f_code)) is None:  # through torch's and the library's
            caller = caller.f_back
        if where is not None and where[0] < callee[0]:
            climbs.add((where[1], callee[1]))

    sys.setprofile(profile)
    try:
        sample.main(argv)
    finally:
        sys.setprofile(None)
    return climbs


def test_the_sample_scripts_walk_climbs_back_at_most_twice(fid_run, tmp_path):
    """sample.py --fid goes straight down the floors but for the two functions it hands down: the FID's observer of
    each drawn batch (to the sample stream) and the draw the memory probe measures."""
    climbs = _climbs_back(["--checkpoint", str(fid_run / "r" / "checkpoints" / "last.ckpt"), "--num-samples", "4",
                           "--batch-size", "3", "--out", str(tmp_path / "s"), "--fid", "--stats-root",
                           str(fid_run / "stats"), "--reference-images", str(REFERENCE)])
    assert climbs == {("sampling/stream.py:_draw", "cli/fid_job.py:observed"),
                      ("metrics/memory.py:peak_tensor_bytes", "cli/sample.py:<lambda>")}
