"""The VAE with an implicit encoder, whose entropy gradient comes from a score network (explicit or DEQ)."""

from . import Declaration

DECLARATION = Declaration(
    name="vae",
    module="deqscore.lightning.VAEModule",
    configs={"shallow": "explicit_mnist.yaml", "deep": "explicit_deep_mnist.yaml", "deq": "deq_mnist.yaml"},
)
