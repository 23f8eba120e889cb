"""Draw samples from any deqscore checkpoint (see :mod:`deqscore.cli.sample` for the outputs):

    python sample.py --checkpoint checkpoints/demo/checkpoints/last.ckpt --num-samples 100 --out samples/
"""

import sys

from deqscore.cli.sample import main

if __name__ == "__main__":
    sys.exit(main())
