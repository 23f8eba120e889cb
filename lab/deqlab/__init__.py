"""Benchmarks of the DEQ layer for score matching: memory, phantom-gradient fidelity, solvers, and each model family.

Run::

    python -m deqlab                       # full sizes (NICE m-net 392/1000, batch 128); minutes on CPU
    python -m deqlab --quick               # small sizes, a few seconds (CI, tests)
    python -m deqlab --device cpu --repeats 3 --sections memory_vs_iterations,solvers --out DIR
    python -m deqlab study --family dkef      # the other programs: study, deq_vs_ffn, kernels, sync, gpu, each a
    python -m deqlab deq_vs_ffn --report-only # branch of the one parser tree (``<program> --help``, deqlab.cli)

It writes ``bench.md`` (markdown tables) and ``bench.json`` (the same numbers) to ``--out`` (default
``benchmarks/results``). Sections: ``memory_vs_iterations`` (activation memory of one SSM step, phantom vs
unrolled DEQ vs explicit MLP), ``phantom_fidelity`` (phantom vs exact SSM gradients, float64), ``solvers``
(Picard/Anderson/Broyden function evaluations), ``nice`` (explicit vs DEQ NICE) and ``dkef`` (DKEF with explicit
shallow, explicit deep and DEQ feature nets on RedWine and synthetic high-dimensional Gaussians, each trained for
the same short budget: parameters, step memory and time, test log-likelihood; ``--sections dkef --out
benchmarks/results/dkef`` takes about 15 minutes on 2 CPU cores), ``ncsn`` (NCSN bodies at 32x32: shallow,
DEQ, NCSNv2; step memory and time, sampling cost, ratios to NCSNv2) and ``vae`` (the implicit-encoder VAE's
explicit vs DEQ score networks, MNIST MLP and 64x64 conv); then a targets table with pass/fail computed
from the measurements. Times are medians over ``--repeats`` steps after one warm-up
(fewer for rows that would exceed the row budget). The family sections build every network from the training
configs (``configs/<family>/*.yaml``) by the training code's builder, with the options stated in their modules
(:mod:`deqlab.families.nice`, ``.dkef``, ``.ncsn``, ``.vae``); the generic sections' sizes are in
:mod:`deqlab.settings`. Activation memory is :func:`deqscore.metrics.step_activation_bytes` throughout:
the tensors autograd saves in one step's forward and backward, parameters excluded (the figure training logs).

From Python: ``run(quick=True, device="cpu", out_dir=tmp_path)`` returns the JSON document.
"""

from .cli import main
from .runner import run

__all__ = ["main", "run"]
