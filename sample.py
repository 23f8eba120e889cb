"""Draw samples from any deqscore checkpoint.

    python sample.py --checkpoint checkpoints/demo/checkpoints/last.ckpt --num-samples 100 --out samples/

Writes ``<out>/samples.png`` (a grid of at most 100) and ``<out>/samples.npz`` (all samples as images in
[0, 1], key ``samples``). The model family and the data transform to undo are read from the checkpoint.
"""

from __future__ import annotations

import argparse
import sys

import torch

from deqscore.errors import ConfigError
from deqscore.lightning import CheckpointFamilyError, load_module
from deqscore.sampling import draw_samples, save_samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="path to a .ckpt written by train.py")
    parser.add_argument("--num-samples", type=int, default=64, help="number of samples")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--batch-size", type=int, default=256, help="samples drawn per call")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.num_samples < 1:
        parser.error("--num-samples must be >= 1")
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    try:
        module = load_module(args.checkpoint, map_location=args.device).eval()
    except (FileNotFoundError, CheckpointFamilyError, ConfigError) as err:
        parser.error(f"--checkpoint: {err}")
    torch.manual_seed(args.seed)
    samples = draw_samples(module.sample_images, args.num_samples, batch_size=args.batch_size)
    png, npz = save_samples(samples, args.out)
    print(f"{len(samples)} samples of the {module.family!r} model -> {png} and {npz}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
