"""The benchmark's own settings, one frozen dataclass per mode (:data:`FULL`, :data:`QUICK`): repeats, seed, inputs
and the sizes of the generic sections (1-3), which benchmark the DEQ layer on constructed blocks. The family sections
(NICE, DKEF, NCSN, VAE) build their networks from the training configs; their options and run sizes are stated in
their own modules (``lab/deqlab/{nice,dkef,ncsn,vae}.py``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

SOLVERS: tuple[str, ...] = ("picard", "anderson", "broyden")
DEFAULT_OUT = "benchmarks/results"
MNIST_DIM = 784  # data dimension for which real (logit-space MNIST) inputs are used
FORCED_TOL = 1e-30  # a tolerance no solve meets: forces exactly max_iter iterations
# Target (c) is judged on the block whose contraction reaches the bound a = 0.5 the normalisation allows: at
# random init the block contracts by ~5e-4, Picard needs 3-4 evaluations and no solver can halve that (those
# rows stay in the table for information).
MAIN_SOLVER_BLOCK = "stress, float32"
RANDOM_INIT_BLOCK = "random init, float32"


@dataclass(frozen=True)
class Settings:
    """Sizes of one benchmark mode. ``d_in`` is the m-net input (half the data dimension)."""

    mode: str = "full"
    out_dir: str = DEFAULT_OUT  # where the report goes (sections with files of their own write beside it)
    seed: int = 0
    trained_checkpoint: str | None = None  # a DEQ-NICE checkpoint: also time the solvers on its trained blocks
    flush_denormal: bool = True  # CPU: denormal floats (vanishing unrolled gradients) are ~100x slower
    repeats: int = 5  # timed steps after one warm-up; the median is reported
    row_budget_s: float = 40.0  # an expensive row times fewer steps so that it stays within about this
    inputs: str = "mnist"  # "mnist" (logit-space MNIST-test, dimension 784 only) or "gaussian"
    # 1. memory_vs_iterations: one SSM step through one coupling with a DEQ block or an explicit MLP
    mem_d_in: int = 392
    mem_hidden: int = 1000
    mem_batch: int = 128
    mem_iterations: tuple[int, ...] = (8, 32, 128)
    mem_phantom_steps: int = 2
    mem_depths: tuple[int, ...] = (2, 8, 16)
    # 2. phantom_fidelity (float64)
    fid_d_in: int = 392
    fid_hidden: int = 1000
    fid_batch: int = 32
    fid_steps: tuple[int, ...] = (1, 2, 4, 8)
    fid_ref_iters: int = 200  # Picard iterations of the unrolled reference (and of the phantom rows' solve)
    fid_power_iters: int = 30  # power iterations for the Jacobian's spectral norm
    # 3. solvers (forward solve only, float32)
    sol_d_in: int = 392
    sol_hidden: int = 1000
    sol_batch: int = 128
    sol_max_iter: int = 128
    sol_tolerances: tuple[tuple[str, float], ...] = (("abs", 2e-5), ("rel", 1e-6))
    sol_blocks: tuple[tuple[str, str], ...] = (
        ("random init", "float32"), ("random init", "float64"), ("stress", "float32"),
    )
    sol_stress_bias: float = 3.0  # biases of the stress block (Softplus' ~ sigmoid(3) = 0.95)

    def as_dict(self) -> dict:
        return asdict(self)


FULL = Settings()
QUICK = replace(
    FULL,
    mode="quick",
    repeats=2,
    row_budget_s=2.0,
    inputs="gaussian",
    mem_d_in=64,
    mem_hidden=128,
    mem_batch=32,
    fid_d_in=32,
    fid_hidden=64,
    fid_batch=8,
    sol_d_in=64,
    sol_hidden=128,
    sol_batch=32,
)


def get_settings(quick: bool, repeats: int | None = None, trained_checkpoint: str | None = None,
                 out_dir: str | None = None) -> Settings:
    """The settings of a mode, with ``repeats``, ``trained_checkpoint`` and ``out_dir`` overridden when given."""
    settings = QUICK if quick else FULL
    if out_dir is not None:
        settings = replace(settings, out_dir=str(out_dir))
    if trained_checkpoint is not None:
        settings = replace(settings, trained_checkpoint=str(trained_checkpoint))
    if repeats is not None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        settings = replace(settings, repeats=repeats)
    return settings
