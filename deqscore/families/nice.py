"""NICE: an energy given by a normalising flow whose coupling networks (m-nets) may be DEQs."""

from . import Declaration

DECLARATION = Declaration(
    name="nice",
    module="deqscore.lightning.NICEModule",
    configs={"shallow": "explicit.yaml", "deep": "explicit_deep.yaml", "deq": "deq.yaml",
             "reference": "deq_reference.yaml"},
    extra_configs=("configs/demo.yaml",),
)
