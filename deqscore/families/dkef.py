"""DKEF: deep kernel exponential families on UCI data, with explicit or DEQ feature networks."""

from . import Declaration

DECLARATION = Declaration(
    name="dkef",
    module="deqscore.lightning.DKEFModule",
    configs={"shallow": "explicit_shallow.yaml", "deep": "explicit_deep.yaml", "deq": "deq.yaml",
             "reference": "deq_reference.yaml"},
)
