"""Plain ``nn.Module`` networks (no Lightning): NICE flows with explicit or DEQ coupling networks."""

from .nice import M_NETS, NICE, DEQMNet, NICEDEQMap, explicit_mlp

__all__ = ["M_NETS", "NICE", "DEQMNet", "NICEDEQMap", "explicit_mlp"]
