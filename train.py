"""Train, validate or test any deqscore model: ``python train.py fit --config configs/nice/deq.yaml``."""

from deqscore.lightning.cli import main

if __name__ == "__main__":
    main()
