"""``python sample.py``: draw samples from any deqscore checkpoint.

    python sample.py --checkpoint checkpoints/demo/checkpoints/last.ckpt --num-samples 100 --out samples/

The model family and the data transform to undo are read from the checkpoint. Writes, in ``--out``:

* ``samples.npz``: all N samples as the array ``samples``, written batch by batch as they are drawn, so memory
  stays one batch whatever N (50,000 CIFAR-10 samples are 600 MB on disk). Read it with
  ``np.load(path)["samples"]``. A model of images writes ``[N, C, H, W]`` images in [0, 1] (``float32``); a model
  of points (DKEF on UCI tables) writes ``[N, D]`` points in the data's own units (its whitening undone).
* ``samples.png``: a grid of the first ``min(N, 100)`` images; for points, a plot of the first
  ``min(N, 2000)`` samples against the held-out (test) rows of the data the checkpoint records, where they can be
  read: a density plot for 2-D points, a scatter plot of a few dimension pairs for more.

Energy models (DKEF) are sampled by Langevin dynamics on their density, Metropolis-adjusted as the checkpoint's
sampler says; ``--steps`` and ``--step-size`` override the chain's length and step size (for NCSN's annealed
sampler: the steps per noise level and the base step size), and the acceptance rate is printed. For a DEQ model
the network evaluations per sample and the solver iterations are printed, and ``--solver-tol`` sets the DEQ
layers' tolerance while sampling (the checkpoint's is the training one, which sampling may not need).

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
missing or unreadable checkpoint, an ``--out`` that cannot be written, counts or step sizes not above 0, an
unavailable device, ``--fid`` without reference images or statistics or for a model of points, a sampler option
the model's sampler does not have, ``--solver-tol`` for a model without a DEQ) are reported in one line with exit
status 2, and nothing written; the output location and the FID reference are checked before anything is drawn.
"""

from __future__ import annotations

import argparse
import importlib
import math
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..lightning import CheckpointFamilyError, ScoreModule, load_module
from ..metrics.memory import peak_tensor_bytes
from ..sampling.cost import counting_cost
from ..sampling.plots import save_point_plot
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


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
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
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="Langevin samplers: steps of each chain (annealed: per noise level), instead of the "
                             "checkpoint's")
    parser.add_argument("--step-size", type=positive_float, default=None,
                        help="Langevin samplers: the step size (annealed: the base step size), instead of the "
                             "checkpoint's")
    parser.add_argument("--solver-tol", type=positive_float, default=None,
                        help="DEQ models: the solvers' tolerance while sampling, instead of the checkpoint's (its "
                             "training tolerance)")
    fid = parser.add_argument_group("FID (--fid)")
    fid.add_argument("--fid", action="store_true",
                     help="compute the FID of the samples against the training set's statistics; writes fid.json")
    fid.add_argument("--fid-stats", default=None,
                     help="an .npz with mu and sigma to compare with instead (e.g. published statistics)")
    fid.add_argument("--data-dir", default=None,
                     help="folder of the training images, or of a point model's data files (default: the run's)")
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


#: samples of a model of points in its plot
PLOT_POINTS = 2000
#: sample.py's option -> the attribute it sets, by sampler (Langevin's, then AnnealedLangevin's)
SAMPLER_OPTIONS = {"steps": ("n_steps", "n_steps_each", "num_steps"), "step_size": ("step_size", "step_lr")}


def set_sampler_options(module: ScoreModule, args: argparse.Namespace) -> None:
    """``--final-denoise``, ``--steps`` and ``--step-size`` set on the module's sampler and ``--solver-tol`` on its
    DEQ layers, or a usage error naming the option the model does not have."""
    sampler = getattr(module, "sampler", None)
    if args.solver_tol is not None:
        if not module.deq_layers():
            usage_error(f"--solver-tol: the {module.family!r} model has no DEQ layer")
        for layer in module.deq_layers():
            layer.tol = args.solver_tol
    if args.final_denoise is not None:
        if not hasattr(sampler, "final_denoise"):
            usage_error(f"--final-denoise: the {module.family!r} model has no annealed Langevin sampler")
        sampler.final_denoise = args.final_denoise == "on"
    for option, attributes in SAMPLER_OPTIONS.items():
        value = getattr(args, option)
        if value is None:
            continue
        attribute = next((a for a in attributes if hasattr(sampler, a)), None)
        if attribute is None:
            usage_error(f"--{option.replace('_', '-')}: the {module.family!r} model's sampler has no such setting")
        setattr(sampler, attribute, value)


def held_out_points(module: ScoreModule, data_dir: str | None) -> tuple[Any, str]:
    """The test rows of the data a point model was trained on, in the data's units (rebuilt from the options the
    checkpoint records; ``data_dir`` in place of their folder), and a note; None and why where they cannot be read."""
    source = getattr(module, "data_source", None)
    if source is None:
        return None, "the checkpoint records no data"
    options = {k: v for k, v in source.items() if k != "class_path"}
    if data_dir is not None:
        options["root"] = data_dir
    try:
        module_name, _, class_name = source["class_path"].rpartition(".")
        datamodule = getattr(importlib.import_module(module_name), class_name)(**options)
        datamodule.setup("test")
        rows = datamodule.test_data.double()
    except Exception as err:  # noqa: BLE001 - missing files, a moved class: the samples are drawn all the same
        return None, f"the held-out data could not be read ({one_line(err)})"
    whitening = getattr(module, "whitening", None)
    return (rows if whitening is None else whitening.to_data(rows)).numpy(), ""


class PointDraws:
    """``module.sample_points`` that keeps the acceptance rate of the Metropolis-adjusted chains it ran."""

    def __init__(self, module: ScoreModule) -> None:
        self.module, self.accepted, self.drawn = module, 0.0, 0

    def __call__(self, k: int) -> torch.Tensor:
        points = self.module.sample_points(k)
        acceptance = getattr(getattr(self.module, "sampler", None), "acceptance", None)
        if acceptance is not None:
            self.accepted, self.drawn = self.accepted + acceptance * k, self.drawn + k
        return points

    def summary(self) -> str:
        return f"; Metropolis acceptance {self.accepted / self.drawn:.3f}" if self.drawn else ""


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
    set_sampler_options(module, args)
    points = module.image_codec is None
    if points and args.fid:
        usage_error(f"--fid: the {module.family!r} model was not trained on images; FID compares images")
    fid = FIDJob.prepare(args, module, device) if args.fid else None  # reference first: a failure draws nothing
    if points:
        draw: Any = PointDraws(module)
        held_out, note = held_out_points(module, args.data_dir)
        plotted: list[str] = []
        picture = lambda samples, path: plotted.append(  # noqa: E731
            save_point_plot(samples, path, held_out, getattr(module.whitening, "columns", ())))
    else:
        draw, picture = module.sample_images if fid is None else fid.observing(module.sample_images), None
    try:
        # the probe draws with the module itself: what it draws is no sample (no FID features, no acceptance)
        check_batch_memory(module.sample_points if points else module.sample_images, args.batch_size,
                           args.num_samples, device)
    except ConfigError as err:  # e.g. a model that cannot draw
        usage_error(f"--checkpoint: {one_line(err)}")
    torch.manual_seed(args.seed)
    net = getattr(module, "net", None)
    try:
        with counting_cost(net if isinstance(net, torch.nn.Module) else torch.nn.Module()) as cost:
            files = stream_samples(draw, args.num_samples, args.out, batch_size=args.batch_size, picture=picture,
                                   picture_size=PLOT_POINTS)
    except (ConfigError, NotImplementedError) as err:  # a model that cannot draw: raised at once, nothing written
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
    if points:
        units = " in the data's units" if module.whitening is not None else ""
        print(f"wrote {files.shape[0]} samples {list(files.shape[1:])} of the {module.family!r} model{units} to "
              f"{files.array}{draw.summary()}, and {plotted[0]} to {files.grid}" + (f" ({note})" if note else ""))
    else:
        print(f"wrote {files.shape[0]} samples {list(files.shape[1:])} of the {module.family!r} model to "
              f"{files.array} and a grid of the first {min(files.shape[0], GRID_SIZE)} to {files.grid}")
    if cost.evaluations:
        batches = -(-files.shape[0] // args.batch_size)  # stream_samples draws full batches and one remainder
        print(f"sampling cost: {cost.describe(batches)}")
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
