"""``python sample.py``: draw samples from any deqscore checkpoint.

    python sample.py --checkpoint checkpoints/demo/checkpoints/last.ckpt --num-samples 100 --out samples/

The model family and the data transform to undo are read from the checkpoint. Writes, in ``--out``:

* ``samples.npz``: all N samples as the array ``samples`` ``[N, C, H, W]`` of images in [0, 1] (``float32``),
  written batch by batch as they are drawn, so memory stays one batch whatever N (50,000 CIFAR-10 samples are
  600 MB on disk). Read it with ``np.load(path)["samples"]``.
* ``samples.png``: a grid of the first ``min(N, 100)`` samples.

Both are written as ``.samples.partial.<pid>.npz`` / ``.png`` and renamed when complete, so an interrupted run
never leaves a ``samples.npz`` that looks complete (an existing one from an earlier run is replaced only then).
With ``--fid``, ``fid.json`` beside them: the FID of the N samples against the training set's Inception statistics
(computed once and cached under ``--stats-root``) or against ``--fid-stats``, with N, the reference, the weights
(averaged or ``--raw-weights``) and the sampler's final denoising step recorded; the features are taken as the
samples are drawn, and the report records the seed, the reference statistics (file and digest) and the SHA-256 of
the ``samples.npz`` it describes. Drawing without ``--fid`` into a folder whose ``fid.json`` described the
samples replaced removes that ``fid.json`` (it would report an FID these samples do not have); one that still
matches (the same seed and batch size draw the same samples) is kept. The same ``--seed`` and ``--batch-size``
give the same samples. Mistakes in the options (a
missing or unreadable checkpoint, an ``--out`` that cannot be written, counts below 1, an unavailable device,
``--fid`` without reference images or statistics) are reported in one line with exit status 2, and nothing
written; the output location and the FID reference are checked before anything is drawn.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..lightning import CheckpointFamilyError, ScoreModule, load_module
from ..metrics.memory import peak_tensor_bytes
from ..sampling.stream import GRID_SIZE, OutputError, check_output_dir, stream_samples
from .errors import OneLineParser, print_error, usage_error
from .fid_job import REPORT_NAME, FIDJob, report_matches


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="path to a .ckpt written by train.py")
    parser.add_argument("--num-samples", type=positive_int, default=64, help="number of samples N")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--batch-size", type=positive_int, default=256, help="samples drawn per call")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--raw-weights", action="store_true",
                        help="sample with the trained weights, not their average (runs with EMA weight averaging)")
    parser.add_argument("--final-denoise", choices=["on", "off"], default=None,
                        help="Langevin samplers: override the checkpoint's final denoising step (FID with and without)")
    fid = parser.add_argument_group("FID (--fid)")
    fid.add_argument("--fid", action="store_true",
                     help="compute the FID of the samples against the training set's statistics; writes fid.json")
    fid.add_argument("--fid-stats", default=None,
                     help="an .npz with mu and sigma to compare with instead (e.g. published statistics)")
    fid.add_argument("--data-dir", default=None, help="folder of the training images (default: the run's)")
    fid.add_argument("--reference-images", type=positive_int, default=None,
                     help="training images in the reference statistics (default: the whole training split)")
    fid.add_argument("--stats-root", default="datasets/fid_stats", help="cache of reference statistics")
    fid.add_argument("--inception-weights", default=None, help="path of the FID Inception weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda, cuda:N or mps (default: cuda when available)")
    return parser.parse_args(argv)


def check_device(name: str) -> torch.device:
    """The device ``name``, or a usage error when it is malformed or not on this machine."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        usage_error(f"--device: {name!r} is not a device; use cpu, cuda, cuda:N or mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            usage_error(f"--device: {name!r} asked for, but CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            usage_error(f"--device: {name!r} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        usage_error(f"--device: {name!r} asked for, but MPS is not available on this machine; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        usage_error(f"--device: {name!r} is not supported; use cpu, cuda, cuda:N or mps")
    return device


#: samples drawn, and operations run, to estimate the memory of a batch before drawing one
PROBE_SAMPLES, PROBE_OPS = 2, 5000
#: the share of the available memory a batch may be estimated to take
MEMORY_SHARE = 0.8


def available_memory(device: torch.device) -> int | None:
    """Bytes that may still be allocated on ``device``: free GPU memory, or the system's ``MemAvailable``; None
    where it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def check_batch_memory(draw: Any, batch_size: int, num_samples: int, device: torch.device) -> None:
    """A usage error, with a batch size that fits, when a batch is estimated to need more memory than ``device``
    has available. The estimate scales the peak tensor memory of a probe draw of :data:`PROBE_SAMPLES` samples
    (stopped after :data:`PROBE_OPS` operations); the probe's random draws are forked off, so the samples drawn
    afterwards are those of a run without it."""
    batch = min(batch_size, num_samples)
    available = available_memory(device)
    if batch <= PROBE_SAMPLES or available is None:
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        peak = peak_tensor_bytes(lambda: draw(PROBE_SAMPLES), max_ops=PROBE_OPS)
    per_sample = max(peak / PROBE_SAMPLES, 1.0)
    need = per_sample * batch
    if need <= MEMORY_SHARE * available:
        return
    fits = int(MEMORY_SHARE * available / per_sample)
    advice = (f"use --batch-size {fits} or less" if fits >= 1 else
              "not even one sample fits: free memory or use another --device")
    usage_error(f"--batch-size {batch_size}: a batch of {batch} samples needs about {_size(need)} on {device} "
                f"(estimated from {PROBE_SAMPLES} samples), more than the {_size(available)} available; {advice}")


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation that failed for want of memory."""
    text = str(err)
    return isinstance(err, MemoryError | torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text))


def _core(err: BaseException) -> str:
    """The gist of a torch.load error in a few words (its weights-only reports run to a dozen lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    marker = "WeightsUnpickler error:"
    at = next((i for i, line in enumerate(lines) if marker in line), None)
    if at is not None:  # the reason follows the marker, on its line or the next
        rest = [lines[at].split(marker, 1)[1].strip(), *lines[at + 1 :]]
        lines = [next(part for part in rest if part)]
    gist = " ".join(lines).split(". ", 1)[0]  # the first sentence; the rest is advice on torch.load's options
    return f"{type(err).__name__}: {gist}" if gist else type(err).__name__


def one_line(err: BaseException) -> str:
    """``err``'s message on one line, a wrapped torch error reduced to its gist."""
    message, cause = str(err), err.__cause__
    if cause is not None and message.endswith(str(cause)):  # "<what>: <torch's report>"
        return f"{message[: len(message) - len(str(cause))].rstrip(': ')} ({_core(cause)})"
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def load(checkpoint: str, device: torch.device, raw_weights: bool = False) -> ScoreModule:
    """The module in ``checkpoint``, or a one-line usage error naming what is wrong with the file."""
    try:
        return load_module(checkpoint, map_location=str(device), raw_weights=raw_weights).eval()
    except (FileNotFoundError, CheckpointFamilyError, ConfigError) as err:
        usage_error(f"--checkpoint: {one_line(err)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = check_device(args.device)
    if not Path(args.checkpoint).is_file():  # as load_module words it, but before the output is looked at
        usage_error(f"--checkpoint: no checkpoint at {args.checkpoint}")
    try:  # the output location is checked before the model is loaded or anything is drawn
        check_output_dir(args.out)
    except OutputError as err:
        usage_error(f"--out: {err}")
    if args.fid and args.num_samples < 2:
        usage_error(f"--fid needs --num-samples >= 2 (a covariance), got {args.num_samples}")
    module = load(args.checkpoint, device, args.raw_weights)
    if args.final_denoise is not None:
        if not hasattr(getattr(module, "sampler", None), "final_denoise"):
            usage_error(f"--final-denoise: the {module.family!r} model has no Langevin sampler")
        module.sampler.final_denoise = args.final_denoise == "on"
    fid = FIDJob.prepare(args, module, device) if args.fid else None  # reference first: a failure draws nothing
    try:
        check_batch_memory(module.sample_images, args.batch_size, args.num_samples, device)
    except ConfigError as err:  # e.g. a model not trained on images
        usage_error(f"--checkpoint: {one_line(err)}")
    torch.manual_seed(args.seed)
    draw = module.sample_images if fid is None else fid.observing(module.sample_images)
    try:
        files = stream_samples(draw, args.num_samples, args.out, batch_size=args.batch_size)
    except ConfigError as err:  # e.g. a model not trained on images: raised by the first draw, nothing written
        usage_error(f"--checkpoint: {one_line(err)}")
    except (MemoryError, RuntimeError) as err:
        if not _out_of_memory(err):
            raise
        smaller = max(1, min(args.batch_size, args.num_samples) // 4)
        usage_error(f"--batch-size {args.batch_size}: drawing a batch ran out of memory on {device} "
                    f"({one_line(err).split('. ')[0]}); nothing was written, use a smaller --batch-size, e.g. "
                    f"{smaller}")
    except OSError as err:  # the disk filled up or the directory went away while writing
        print_error(f"writing samples to {args.out} failed (partial files removed): {err}")
        return 1
    print(f"wrote {files.shape[0]} samples {list(files.shape[1:])} of the {module.family!r} model to {files.array} "
          f"and a grid of the first {min(files.shape[0], GRID_SIZE)} to {files.grid}")
    cost = getattr(module, "sampling_report", None)  # a family's sampler cost (EDM: evaluations, DEQ iterations)
    if cost is not None and cost():
        print(cost())
    report_path = Path(args.out) / REPORT_NAME
    if fid is not None:
        try:
            report = fid.finish(report_path, files.array, files.shape[0])
        except ValueError as err:
            report_path.unlink(missing_ok=True)  # the earlier report describes the samples just replaced
            print_error(str(err))
            return 1
        print(f"FID {report['fid']:.3f} from {report['num_samples']} samples against {report['reference']} "
              f"(written to {report_path})")
    elif report_path.exists() and not report_matches(report_path, files.array):
        report_path.unlink()
        print(f"removed {report_path}: it described the samples that {files.array} held before (draw with --fid "
              "for a report of these)")
    return 0


def console() -> None:
    """The ``deqscore-sample`` command (what ``python sample.py`` does, for an installed package)."""
    raise SystemExit(main())
