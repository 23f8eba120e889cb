"""Every size and setting of the benchmark, one frozen dataclass per mode (:data:`FULL`, :data:`QUICK`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

SECTIONS: tuple[str, ...] = ("memory_vs_iterations", "phantom_fidelity", "solvers", "nice", "dkef", "ncsn", "vae")
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
    # 4. nice: explicit vs DEQ NICE, one SSM step (float32)
    nice_dim: int = 784
    nice_hidden: int = 1000
    nice_batch: int = 128
    nice_couplings: tuple[int, ...] = (4, 2)
    nice_n_layers: int = 5
    nice_solver: str = "picard"  # DEQ settings: the defaults of deqscore/lightning/nice.py
    nice_tol: float = 2e-5
    nice_max_iter: int = 128
    nice_phantom_steps: int = 2
    nice_warm_start: bool = False  # cold start from zeros in every step (the Lightning default warm-starts)
    # 5. dkef: explicit shallow / explicit deep / DEQ feature nets, trained for a fixed budget (float32)
    dkef_redwine: bool = True  # RedWine rows (skipped with a note when its file is not in dkef_data_root)
    dkef_data_root: str = "../shared/data"  # folder of winequality-red.csv, relative to the repository root
    dkef_data_seed: int = 2019  # UCIDataModule seed (shuffle, dequantisation, noise, highdim draws)
    dkef_dims: tuple[int, ...] = (50, 200, 800)  # dimensions of the synthetic highdim N(0, I) data
    dkef_n_centres: int = 200
    dkef_hidden: int = 30
    dkef_deep_layers: int = 16  # Linear layers of the explicit deep feature net
    dkef_loss: str = "ssm_vr"
    dkef_batch: int = 200  # alpha on the first half, the loss on the second
    dkef_steps: int = 100  # training steps of every net (the first one, the warm-up, is measured for memory)
    dkef_steps_by_dim: tuple[tuple[int, int], ...] = ((800, 40),)  # (dim, steps) overriding dkef_steps
    dkef_lr: float = 0.01  # Adam
    dkef_clip: float = 100.0  # gradient-norm clipping
    dkef_solver: str = "picard"  # DEQ feature net: the options of configs/dkef/deq.yaml, cold start
    dkef_tol: float = 5e-5
    dkef_max_iter: int = 128
    dkef_phantom_steps: int = 2
    dkef_bandwidth_init: str = "median"  # DKEF bandwidth_init: "median" (from the data) or "fixed" (10^l as given)
    dkef_alpha_points: int = 1000  # training points alpha is refreshed on after training (and the median uses)
    dkef_alpha_chunk: int = 250  # points per chunk of that alpha system
    dkef_log_z_samples: int = 100_000  # importance samples of log Z on highdim (10 s per model at D = 800)
    dkef_log_z_samples_redwine: int = 1_000_000  # ... on RedWine (the Lightning module's test-time count)
    dkef_log_z_chunk: int = 10_000
    dkef_proposal_std: float = 2.0
    # 6. ncsn: bodies at 32x32 (one training step, sampling cost)
    ncsn_side: int = 32
    ncsn_ngf: int = 128
    ncsn_batch: int = 128
    ncsn_losses: tuple[str, ...] = ("annealed_dsm", "annealed_ssm_vr")
    ncsn_config: str = "configs/ncsn/deq_cifar10.yaml"  # the noise schedule is this config's (CIFAR-10)
    ncsn_levels: int | None = None  # None: the config's number of levels
    ncsn_langevin_steps: int = 5  # per level
    ncsn_sample_batch: int = 128
    ncsn_solver: str = "anderson"  # the reference's Picard at an absolute 1e-5 over the whole batch runs to
    ncsn_tol: float = 1e-3  # max_iter at this size; a relative tolerance keeps CPU rows affordable
    ncsn_stop_mode: str = "rel"
    ncsn_max_iter: int = 40
    # 7. vae: explicit vs DEQ score networks of the implicit-encoder VAE (configs/vae/*_mnist, *_celeba)
    vae_batch: int = 128  # MNIST MLP
    vae_conv_batch: int = 16  # 64x64 conv: the DEQ's full-resolution solve makes CPU rows slow at 128
    vae_hidden: int = 256  # MNIST MLP width
    vae_side: int = 64  # conv: CelebA 64x64
    vae_nef: int = 64
    vae_score_updates: int = 2
    vae_tol: float = 5e-6  # the configs' Picard tolerance (absolute, whole batch)
    vae_max_iter: int = 128

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
    nice_dim=64,
    nice_hidden=128,
    nice_batch=32,
    dkef_dims=(8, 16),
    dkef_n_centres=10,
    dkef_hidden=8,
    dkef_batch=40,
    dkef_steps=5,
    dkef_steps_by_dim=(),
    dkef_alpha_points=100,
    dkef_alpha_chunk=50,
    dkef_log_z_samples=2000,
    dkef_log_z_samples_redwine=2000,
    dkef_log_z_chunk=1000,
    ncsn_side=8,
    ncsn_ngf=4,
    ncsn_batch=4,
    ncsn_levels=10,
    ncsn_sample_batch=4,
    vae_batch=4,
    vae_conv_batch=4,
    vae_hidden=16,
    vae_side=16,
    vae_nef=4,
    vae_max_iter=20,
)


def get_settings(quick: bool, repeats: int | None = None, trained_checkpoint: str | None = None) -> Settings:
    """The settings of a mode, with ``repeats`` and ``trained_checkpoint`` overridden when given."""
    settings = QUICK if quick else FULL
    if trained_checkpoint is not None:
        settings = replace(settings, trained_checkpoint=str(trained_checkpoint))
    if repeats is not None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        settings = replace(settings, repeats=repeats)
    return settings
