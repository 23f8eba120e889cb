"""EDM: preconditioned denoisers (Karras et al. 2022) with an explicit U-Net or a DEQ middle, Heun sampling."""

from . import Declaration

DECLARATION = Declaration(
    name="edm",
    module="deqscore.lightning.edm.EDMModule",
    configs={"shallow": "explicit_mnist.yaml", "deq": "deq_mnist.yaml"},
)
