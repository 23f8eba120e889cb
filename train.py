"""Train, validate or test any deqscore model: ``python train.py fit --config configs/nice/deq.yaml``."""

import sys

from deqscore.cli.train import run

if __name__ == "__main__":
    sys.exit(run())
