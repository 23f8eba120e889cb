"""sample.py and deqscore.sampling: samples streamed to disk in bounded memory, and one-line usage errors."""

from __future__ import annotations

import os
import sys
import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
from deqscore import files
from deqscore.cli import sample as sampling_cli
from deqscore.data.transforms import ImageCodec
from deqscore.lightning import build_module, load_module
from deqscore.sampling import NpyAppender, OutputError, check_output_dir, stream_samples

TINY_NICE = {"class_path": "deqscore.lightning.NICEModule",
             "init_args": {"net": {"class_path": "deqscore.models.NICE",
                                   "init_args": {"dim": 4, "n_couplings": 1, "hidden": 4, "n_layers": 2}}}}


def _save_checkpoint(path: Path, codec: ImageCodec | None) -> Path:
    """A checkpoint as Lightning writes it (state dict, hyper-parameters, the module's own keys)."""
    module = build_module(TINY_NICE)
    module.image_codec = codec
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"
    return _save_checkpoint(path, ImageCodec("logit_squeeze", 1e-3, (1, 2, 2)))


class IndexImages:
    """``draw(k)``: the next ``k`` images ``[k, 1, 3, 3]``, image ``i`` filled with ``i / n``; records each call."""

    def __init__(self, n: int, shape: tuple[int, ...] = (1, 3, 3)) -> None:
        self.n, self.shape, self.calls, self.returned = n, shape, [], []

    def __call__(self, k: int) -> torch.Tensor:
        start = sum(self.calls)
        self.calls.append(k)
        index = torch.arange(start, start + k, dtype=torch.float32).view(k, *[1] * len(self.shape))
        batch = (index / self.n).expand(k, *self.shape).contiguous()
        self.returned.append(batch.clone())
        return batch


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")}


# ----- streaming ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "batch_size", "calls"), [(23, 5, [5, 5, 5, 5, 3]), (3, 256, [3]), (8, 4, [4, 4])])
def test_stream_writes_exactly_the_drawn_samples(tmp_path, n, batch_size, calls):
    draw = IndexImages(n)
    files = stream_samples(draw, n, tmp_path / "out", batch_size=batch_size, progress=False)
    assert draw.calls == calls  # never more than batch_size at once, and exactly n in all
    arr = np.load(files.array)["samples"]
    assert files.array == tmp_path / "out" / "samples.npz" and arr.shape == files.shape == (n, 1, 3, 3)
    assert arr.dtype == np.float32
    np.testing.assert_array_equal(arr, torch.cat(draw.returned).numpy())  # batch by batch, as drawn
    np.testing.assert_array_equal(arr[:, 0, 1, 2], np.arange(n, dtype=np.float32) / n)
    assert files.grid.stat().st_size > 0
    assert _files(tmp_path / "out") == {Path("samples.npz"), Path("samples.png")}  # no partial file left


def test_batches_are_appended_to_the_file_as_they_are_drawn(tmp_path):
    out, sizes = tmp_path / "out", []
    draw = IndexImages(10, (1, 4, 4))

    def watching(k: int) -> torch.Tensor:
        partial = list(out.glob(".samples.partial.*.npz")) if out.exists() else []
        sizes.append(partial[0].stat().st_size if partial else None)
        return draw(k)

    stream_samples(watching, 10, out, batch_size=3, progress=False)
    # nothing exists before the first batch; then the file grows by one flushed batch (3 x 16 floats) per call
    assert sizes[0] is None and not any(s is None for s in sizes[1:])
    assert np.diff(sizes[1:]).tolist() == [3 * 16 * 4] * 2
    header = sizes[1] - 3 * 16 * 4
    # then the archive's directory is added (zip64 records and one entry: well under a kilobyte)
    assert 0 < (out / "samples.npz").stat().st_size - (header + 10 * 16 * 4) < 1024


def test_no_batch_is_kept_once_written_and_peak_memory_is_one_batch(tmp_path):
    n, batch_size, shape = 4000, 50, (1, 32, 32)  # 4 KiB an image: 200 KiB a batch, 16 MB in all
    image_bytes = 4 * 32 * 32
    alive: list[weakref.ref] = []
    live_at_call: list[int] = []

    def draw(k: int) -> torch.Tensor:
        live_at_call.append(sum(ref() is not None for ref in alive))
        array = np.full((k, *shape), len(alive) / 100, dtype=np.float32)  # numpy memory is seen by tracemalloc
        alive.append(weakref.ref(array))
        return torch.from_numpy(array)

    stream_samples(IndexImages(2, shape), 2, tmp_path / "warm-up", progress=False)  # lazy imports happen here
    tracemalloc.start()
    try:
        files = stream_samples(draw, n, tmp_path / "out", batch_size=batch_size, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert live_at_call == [0] * (n // batch_size)  # each batch is freed before the next is drawn
    # a batch or two in flight, the 100-image preview and bookkeeping; keeping the batches would take 16 MB
    assert peak < 2 * batch_size * image_bytes + 100 * image_bytes + 256 * 1024, peak
    arr = np.load(files.array)["samples"]
    assert arr.shape == (n, *shape) and float(arr[-1, 0, 0, 0]) == pytest.approx((n // batch_size - 1) / 100)


@pytest.mark.parametrize("error", [RuntimeError("the model blew up"), KeyboardInterrupt()])
def test_an_interrupted_run_leaves_no_final_or_partial_file(tmp_path, error):
    (tmp_path / "samples.npz").write_bytes(b"an earlier run")
    draw = IndexImages(12)

    def failing(k: int) -> torch.Tensor:
        if len(draw.calls) == 2:
            raise error
        return draw(k)

    with pytest.raises(type(error)):
        stream_samples(failing, 12, tmp_path, batch_size=4, progress=False)
    assert draw.calls == [4, 4]  # it failed mid-way, with two batches written
    assert _files(tmp_path) == {Path("samples.npz")} and (tmp_path / "samples.npz").read_bytes() == b"an earlier run"


def test_a_draw_failing_at_once_creates_nothing(tmp_path):
    def failing(k: int) -> torch.Tensor:
        raise ValueError("no codec")

    with pytest.raises(ValueError, match="no codec"):
        stream_samples(failing, 5, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("member", [None, "x"])  # an .npy file, or the array "x" of an .npz archive
def test_appender_refuses_rows_that_do_not_fit(tmp_path, member):
    suffix = ".npy" if member is None else ".npz"
    with NpyAppender(tmp_path / f"a{suffix}", (3, 2), np.float32, member) as writer:
        writer.append(np.zeros((2, 2), np.float32))
        with pytest.raises(ValueError, match="does not fit"):
            writer.append(np.zeros((1, 3), np.float32))
        with pytest.raises(ValueError, match="exceed"):
            writer.append(np.zeros((2, 2), np.float32))
        with pytest.raises(ValueError, match="does not fit"):
            writer.append(np.zeros((1, 2), np.float64))
        writer.append(np.ones((1, 2), np.float32))
    loaded = np.load(tmp_path / f"a{suffix}")
    loaded = loaded if member is None else loaded[member]
    np.testing.assert_array_equal(loaded, [[0, 0], [0, 0], [1, 1]])  # refused rows left no trace
    # leaving the block with a row missing is an error too (the header promises 3)
    with pytest.raises(ValueError, match="holds 2 rows"), \
            NpyAppender(tmp_path / f"b{suffix}", (3,), np.int64, member) as w:
        w.append(np.arange(2))


def test_check_output_dir(tmp_path):
    check_output_dir(tmp_path / "new" / "deeper")  # creatable: fine, and nothing is created
    assert _files(tmp_path) == set()
    (tmp_path / "file").write_text("x")
    (tmp_path / "d" / "samples.npz").mkdir(parents=True)
    for out, match in ((tmp_path / "file", "exists and is not a directory"),
                       (tmp_path / "file" / "sub" / "dir", "file is not a directory"),
                       (tmp_path / "d", "samples.npz is a directory")):
        with pytest.raises(OutputError, match=match):
            check_output_dir(out)
    assert _files(tmp_path) == {Path("file"), Path("d"), Path("d/samples.npz")}


# ----- sample.py -----------------------------------------------------------------------------------------------
def _run(argv: list[str]) -> None:
    sample.main([str(a) for a in argv])


def test_sample_script_end_to_end(tmp_path, checkpoint, capsys):
    _run(["--checkpoint", checkpoint, "--num-samples", 7, "--out", tmp_path / "a", "--batch-size", 3, "--seed", 5])
    out, err = capsys.readouterr()
    arr = np.load(tmp_path / "a" / "samples.npz")["samples"]
    assert arr.shape == (7, 1, 2, 2) and arr.dtype == np.float32 and (arr >= 0).all() and (arr <= 1).all()
    assert (tmp_path / "a" / "samples.png").stat().st_size > 0
    assert out.strip().splitlines()[-1] == (f"wrote 7 samples [1, 2, 2] of the 'nice' model to {tmp_path}/a/samples.npz"
                                            f" and a grid of the first 7 to {tmp_path}/a/samples.png")
    assert "7/7" in err  # the progress bar counted every sample
    # the file holds what the module draws batch by batch from the seed
    module = load_module(checkpoint).eval()
    torch.manual_seed(5)
    expected = torch.cat([module.sample_images(k) for k in (3, 3, 1)]).numpy()
    np.testing.assert_array_equal(arr, expected)
    # the same seed and batch size give the same samples; another seed gives others
    _run(["--checkpoint", checkpoint, "--num-samples", 7, "--out", tmp_path / "b", "--batch-size", 3, "--seed", 5])
    _run(["--checkpoint", checkpoint, "--num-samples", 7, "--out", tmp_path / "c", "--batch-size", 3, "--seed", 6])
    np.testing.assert_array_equal(np.load(tmp_path / "b" / "samples.npz")["samples"], arr)
    assert not np.allclose(np.load(tmp_path / "c" / "samples.npz")["samples"], arr)


@pytest.fixture
def no_loading(monkeypatch):
    """Make loading a model fail loudly: usage errors must be found before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the usage error was reported")

    monkeypatch.setattr(sampling_cli, "load_module", refuse)


def _usage_error(argv: list, capsys, root: Path) -> str:
    before = _files(root)
    with pytest.raises(SystemExit) as info:
        _run(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2, err
    assert err.count("\n") == 1 and ": error: " in err, err  # one line
    assert "Traceback" not in err and "usage:" not in err and out == ""
    assert _files(root) == before  # nothing written
    return err


@pytest.mark.parametrize(("extra", "option", "words"), [
    (["--num-samples", "0"], "--num-samples", "must be >= 1, got 0"),
    (["--num-samples", "-5"], "--num-samples", "must be >= 1, got -5"),
    (["--num-samples", "many"], "--num-samples", "expected a whole number"),
    (["--batch-size", "0"], "--batch-size", "must be >= 1, got 0"),
    (["--batch-size", "-1"], "--batch-size", "must be >= 1, got -1"),
    (["--device", "gpu7"], "--device", "'gpu7' is not a device"),
    (["--steps", "0"], "--steps", "must be >= 1, got 0"),
    (["--step-size", "0"], "--step-size", "must be a finite number > 0, got 0"),
    (["--step-size", "-0.1"], "--step-size", "must be a finite number > 0, got -0.1"),
    (["--step-size", "nan"], "--step-size", "must be a finite number > 0, got nan"),
    (["--step-size", "big"], "--step-size", "expected a number > 0, got 'big'"),
])
def test_bad_counts_and_devices_are_usage_errors(tmp_path, checkpoint, capsys, no_loading, extra, option, words):
    err = _usage_error(["--checkpoint", checkpoint, "--out", tmp_path / "out", *extra], capsys, tmp_path)
    assert option in err and words in err


def test_cuda_when_unavailable_is_a_usage_error(tmp_path, checkpoint, capsys, no_loading, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _usage_error(["--checkpoint", checkpoint, "--out", tmp_path / "out", "--device", "cuda"], capsys, tmp_path)
    assert "--device: 'cuda'" in err and "CUDA is not available" in err


def test_bad_output_locations_are_usage_errors(tmp_path, checkpoint, capsys, no_loading):
    (tmp_path / "file").write_text("x")
    for out, words in ((tmp_path / "file", "exists and is not a directory"),
                       (tmp_path / "file" / "out", "is not a directory")):
        err = _usage_error(["--checkpoint", checkpoint, "--out", out], capsys, tmp_path)
        assert "--out: " in err and str(tmp_path / "file") in err and words in err, err


def test_a_directory_that_cannot_be_written_is_a_usage_error(tmp_path, checkpoint, capsys, no_loading, monkeypatch):
    def denied(*args, **kwargs):  # what creating a file in a read-only directory gives a user who is not root
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files.tempfile, "TemporaryFile", denied)
    err = _usage_error(["--checkpoint", checkpoint, "--out", tmp_path / "new" / "out"], capsys, tmp_path)
    assert f"--out: cannot write in {tmp_path}: Permission denied" in err


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root writes in read-only directories")
def test_a_read_only_directory_is_a_usage_error(tmp_path, checkpoint, capsys, no_loading):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        err = _usage_error(["--checkpoint", checkpoint, "--out", locked / "out"], capsys, tmp_path)
    finally:
        locked.chmod(0o755)
    assert f"--out: cannot write in {locked}" in err


def test_missing_and_unreadable_checkpoints_are_usage_errors(tmp_path, capsys):
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    torch.save([1, 2], tmp_path / "list.ckpt")
    for name, words in (("missing.ckpt", "no checkpoint at"),
                        ("junk.ckpt", "is not a readable PyTorch checkpoint (UnpicklingError: Unsupported operand"),
                        ("empty.ckpt", "is not a readable PyTorch checkpoint (EOFError)"),
                        ("list.ckpt", "is not a deqscore checkpoint")):
        err = _usage_error(["--checkpoint", tmp_path / name, "--out", tmp_path / "out"], capsys, tmp_path)
        assert f"--checkpoint: {tmp_path / name}" in err or f"--checkpoint: no checkpoint at {tmp_path / name}" in err
        assert words in err, err


def test_a_model_without_images_writes_points_and_refuses_what_needs_images_or_a_chain(tmp_path, capsys):
    path = _save_checkpoint(tmp_path / "nocodec.ckpt", codec=None)
    _run(["--checkpoint", path, "--num-samples", 5, "--out", tmp_path / "a", "--batch-size", 3, "--seed", 2])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    arr = np.load(tmp_path / "a" / "samples.npz")["samples"]
    module = load_module(path).eval()
    torch.manual_seed(2)
    np.testing.assert_array_equal(arr, torch.cat([module.sample(3), module.sample(2)]).numpy())  # model space
    assert (tmp_path / "a" / "samples.png").stat().st_size > 0
    assert out == (f"wrote 5 samples [4] of the 'nice' model to {tmp_path}/a/samples.npz, and a pairwise scatter "
                   f"plot of dimensions (1, 2), (3, 4) to {tmp_path}/a/samples.png (the checkpoint records no data)")
    for extra, words in ((["--fid"], "--fid: the 'nice' model was not trained on images"),
                         (["--steps", "3"], "--steps: the 'nice' model's sampler has no such setting"),
                         (["--step-size", "0.1"], "--step-size: the 'nice' model's sampler has no such setting"),
                         (["--final-denoise", "off"], "--final-denoise: the 'nice' model has no annealed Langevin"),
                         (["--solver-tol", "0.01"], "--solver-tol: the 'nice' model has no DEQ layer")):
        err = _usage_error(["--checkpoint", path, "--out", tmp_path / "out", *extra], capsys, tmp_path)
        assert words in err, err


def test_missing_options_are_one_line(tmp_path, capsys):
    err = _usage_error(["--num-samples", "3"], capsys, tmp_path)
    assert "the following arguments are required: --checkpoint, --out" in err


# ----- fid.json: what it describes ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_stats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deqscore.metrics.reference import save_stats
    from deqscore.metrics.statistics import GaussianStats

    path = tmp_path_factory.mktemp("stats") / "ref.npz"
    rng = np.random.default_rng(0)
    save_stats(path, GaussianStats(mu=rng.normal(size=2048), sigma=np.eye(2048), count=10))
    return path


@pytest.fixture
def quick_fid(monkeypatch):
    """sample.py --fid with stand-ins for the Inception network and the distance (both tested in tests/metrics):
    these tests are about what fid.json describes."""
    from deqscore.cli import fid_job
    from deqscore.metrics import quality

    class Features(torch.nn.Module):
        def forward(self, images):
            return images.flatten(1).mean(1, keepdim=True).expand(-1, 2048) + torch.arange(2048.0)

    monkeypatch.setattr(fid_job, "InceptionFeatures", lambda weights=None: Features())
    monkeypatch.setattr(quality, "sample_quality", lambda stats, reference, seed=0: {
        "fid": float(stats.mu.sum()), "num_samples": stats.count, "label": f"FID@{stats.count}"})


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _draw(out: Path, checkpoint: Path, seed: int, *extra) -> None:
    _run(["--checkpoint", checkpoint, "--num-samples", 4, "--out", out, "--batch-size", 2, "--seed", seed, *extra])


def test_fid_json_records_the_samples_it_describes_and_a_stale_one_is_removed(tmp_path, checkpoint, reference_stats,
                                                                            quick_fid, capsys):
    import json

    out = tmp_path / "s"
    _draw(out, checkpoint, 3, "--fid", "--fid-stats", reference_stats)
    report = json.loads((out / "fid.json").read_text())
    assert report["num_samples"] == 4 and report["seed"] == 3
    assert report["samples"] == "samples.npz" and report["samples_sha256"] == _sha256(out / "samples.npz")
    assert report["reference_stats"]["file"] == str(reference_stats) and report["reference_stats"]["count"] == 10
    assert len(report["reference_stats"]["moments_sha256"]) == 64
    kept = (out / "fid.json").read_bytes()
    # the same seed and batch size draw the same samples: the report still describes them and is kept
    _draw(out, checkpoint, 3)
    assert (out / "fid.json").read_bytes() == kept
    # other samples without --fid: the report of the replaced ones is removed, and the user is told
    capsys.readouterr()
    _draw(out, checkpoint, 4)
    assert not (out / "fid.json").exists() and "removed" in capsys.readouterr().out


def test_no_fid_is_reported_for_samples_other_than_those_whose_features_were_taken(tmp_path, checkpoint,
                                                                                   reference_stats, quick_fid,
                                                                                   monkeypatch, capsys):
    from deqscore.cli import fid_job

    out = tmp_path / "s"
    _draw(out, checkpoint, 3, "--fid", "--fid-stats", reference_stats)
    original = fid_job.FIDJob.observing

    def skipping_a_batch(self, draw):  # features of the first batch only: they describe other samples than the file
        observed, calls = original(self, draw), []

        def once(k):
            calls.append(k)
            return observed(k) if len(calls) == 1 else draw(k)

        return once

    monkeypatch.setattr(fid_job.FIDJob, "observing", skipping_a_batch)
    capsys.readouterr()
    assert sampling_cli.main(["--checkpoint", str(checkpoint), "--num-samples", "4", "--out", str(out),
                              "--batch-size", "2", "--seed", "5", "--fid", "--fid-stats", str(reference_stats)]) == 1
    out_text, err = capsys.readouterr()
    assert "no FID is reported" in err and "FID " not in out_text and "Traceback" not in err
    assert not (out / "fid.json").exists()  # the earlier report described the samples just replaced


# ----- a batch too large for the memory ------------------------------------------------------------------------
def test_a_batch_larger_than_the_memory_is_refused_with_a_size_that_fits(tmp_path, checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(sampling_cli, "available_memory", lambda device: 200_000)  # bytes
    err = _usage_error(["--checkpoint", checkpoint, "--out", tmp_path / "out", "--num-samples", 10**5,
                        "--batch-size", 10**6], capsys, tmp_path)
    assert "--batch-size 1000000: a batch of 100000 samples needs about" in err, err
    assert "more than the 195.3 KB available; use --batch-size" in err, err
    suggested = int(err.split("use --batch-size ")[1].split()[0])
    assert 1 <= suggested < 10**5
    # the suggested size fits, and the probe before it changes no sample: the same seed draws the same as before
    _run(["--checkpoint", checkpoint, "--out", tmp_path / "a", "--num-samples", 7, "--batch-size", 3, "--seed", 5])
    monkeypatch.setattr(sampling_cli, "available_memory", lambda device: None)  # no probe
    _run(["--checkpoint", checkpoint, "--out", tmp_path / "b", "--num-samples", 7, "--batch-size", 3, "--seed", 5])
    np.testing.assert_array_equal(np.load(tmp_path / "a" / "samples.npz")["samples"],
                                  np.load(tmp_path / "b" / "samples.npz")["samples"])
    monkeypatch.setattr(sampling_cli, "available_memory", lambda device: 200_000)
    _run(["--checkpoint", checkpoint, "--out", tmp_path / "c", "--num-samples", suggested, "--batch-size", suggested])
    assert np.load(tmp_path / "c" / "samples.npz")["samples"].shape[0] == suggested


def test_an_allocation_that_fails_while_drawing_is_one_message(tmp_path, checkpoint, capsys, monkeypatch):
    def huge(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 429496729600 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(sampling_cli, "available_memory", lambda device: None)
    monkeypatch.setattr(sampling_cli, "stream_samples", huge)
    err = _usage_error(["--checkpoint", checkpoint, "--out", tmp_path / "out", "--batch-size", 4096], capsys, tmp_path)
    assert "--batch-size 4096: drawing a batch ran out of memory on cpu" in err and "e.g. 16" in err, err
