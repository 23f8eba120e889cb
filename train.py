"""Train, validate or test any deqscore model: ``python train.py fit --config configs/nice/deq.yaml`` (installed:
``deqscore-train``)."""

from deqscore.cli.train import console

if __name__ == "__main__":
    console()
