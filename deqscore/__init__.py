"""deqscore: memory-efficient score matching with deep-equilibrium layers, on PyTorch Lightning.

Sub-packages: :mod:`deqscore.deq` (solvers, DEQ layer), :mod:`deqscore.losses`, :mod:`deqscore.models`,
:mod:`deqscore.data`, :mod:`deqscore.lightning`, :mod:`deqscore.sampling` and :mod:`deqscore.metrics`. The
benchmarks and the reproduction study are the repository's laboratory (``lab/``), a distribution of its own.

>>> import torch
>>> from deqscore.losses import exact_score_matching
>>> float(exact_score_matching(lambda x: -x, torch.zeros(1, 3))[0])  # N(0, I): 0.5*||0||^2 - tr(I)
-3.0
"""

__version__ = "0.1.0"
