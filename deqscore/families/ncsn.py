"""NCSN: noise-conditional score networks (annealed DSM, annealed Langevin sampling) with explicit or DEQ bodies."""

from . import Declaration

DECLARATION = Declaration(
    name="ncsn",
    module="deqscore.lightning.NCSNModule",
    configs={"shallow": "explicit_mnist.yaml", "deep": "ncsnv2_mnist.yaml", "deq": "deq_mnist.yaml"},
)
