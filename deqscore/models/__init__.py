"""Plain ``nn.Module`` networks (no Lightning): NICE flows with explicit or DEQ coupling networks, and NICE's
own losses (maximum likelihood, Kingma and curvature-propagation approximate backprop); DKEF, the deep kernel
exponential family with its closed-form coefficient solve; NCSN, noise-conditional score networks (NCSNv2, a
shallow explicit baseline, a DEQ body); VAEs with an implicit encoder and a score network for its entropy
gradient, and the Gaussian-encoder baseline."""

from .dkef import ALPHA_OBJECTIVES, DKEF, DKEF_FEATURE_NETS
from .dkef_features import DEQFeatureBody, DKEFDEQMap, DKEFFeatureNet
from .ncsn import NCSN, NCSN_BODIES, NCSNDEQMap
from .nice import M_NETS, NICE, DEQMNet, NICEDEQMap, explicit_mlp
from .nice_losses import CurvaturePropagationSM, KingmaSM, MaximumLikelihood, NICEObjective
from .vae import SCORE_NETS, VAE_ARCHS, GaussianVAE, ImplicitVAE

__all__ = [
    "ALPHA_OBJECTIVES",
    "DKEF",
    "DKEF_FEATURE_NETS",
    "DEQFeatureBody",
    "DKEFDEQMap",
    "DKEFFeatureNet",
    "M_NETS",
    "NCSN",
    "NCSN_BODIES",
    "NCSNDEQMap",
    "NICE",
    "CurvaturePropagationSM",
    "DEQMNet",
    "KingmaSM",
    "MaximumLikelihood",
    "NICEDEQMap",
    "NICEObjective",
    "SCORE_NETS",
    "VAE_ARCHS",
    "GaussianVAE",
    "ImplicitVAE",
    "explicit_mlp",
]
