"""``UCIDataModule``: the UCI density-estimation benchmarks of the deep kernel exponential family (DKEF)
experiments (Wenliang et al. 2019), plus a synthetic high-dimensional Gaussian whose density is known.

Data sets (``dataset=``):

* ``"redwine"`` / ``"whitewine"``: ``winequality-red.csv`` / ``winequality-white.csv`` (UCI "Wine Quality",
  ``;``-separated, quoted header); the 11 physicochemical columns, ``quality`` dropped.
* ``"parkinsons"``: ``parkinsons_updrs.data`` (UCI "Parkinsons Telemonitoring", ``,``-separated); the columns
  from ``test_time`` on (``subject#``, ``age``, ``sex`` dropped), less those correlated above 0.98 with another
  (15 of 19 remain with the reference rule, see :func:`prune_correlated`).
* ``"highdim"``: synthetic N(0, I) in ``dim`` dimensions, 4860 / 540 / 600 train / val / test rows; the true
  log density and score are available (:meth:`UCIDataModule.true_log_prob`, :meth:`UCIDataModule.true_score`).

The files are looked for in ``root``; :meth:`UCIDataModule.prepare_data` downloads a missing one from the UCI
repository (never :meth:`~UCIDataModule.setup`). A file's SHA-256 is compared with that of the original UCI
file: a mismatch only warns (another parseable copy may be legitimate), a file that cannot be parsed raises
:class:`~deqscore.data.errors.CorruptDataError`.

Pre-processing of the real data sets, in this order (all randomness from ``numpy.random.RandomState(seed)``):

1. rows shuffled;
2. wine only: dequantisation, each column gets ``U(-g/2, g/2)`` noise with ``g`` the median gap between the
   column's sorted distinct values, so a value stays in its quantisation bin (the reference code draws
   ``U(-g, g)``);
3. split: ``test = min(1000, N // 10)`` rows, ``val = min(1000, (N - test) // 10)``, the rest trains (in that
   order of the shuffled rows: train, val, test);
4. PCA whitening ``x -> (x - mean) @ whiten_matrix`` fitted on all rows (``whiten_on="all"``, as the
   reference) or on the training rows only (``whiten_on="train"``): the fitting set then has mean 0 and
   covariance I (normalised by N, as the reference);
5. ``N(0, noise_std^2)`` noise added once to every split.

Config use (LightningCLI)::

    data:
      class_path: deqscore.data.UCIDataModule
      init_args: {dataset: redwine, root: datasets/uci, batch_size: 200, noise_std: 0.05}
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from deqscore.data.datasets import epoch_loader
from deqscore.data.errors import CorruptDataError, DataNotFoundError
from deqscore.data.points import Whitening, fit_whitening
from deqscore.data.uci_files import UCI_FILES, UCIFile, download_file, read_uci_table
from deqscore.errors import ConfigError, check_count, choice_error

__all__ = [
    "DATASETS",
    "UCI_FILES",
    "UCIDataModule",
    "UCIFile",
    "Whitening",
    "dequantize_columns",
    "download_file",
    "fit_whitening",
    "median_gaps",
    "prune_correlated",
    "read_uci_table",
    "split_sizes",
]

DATASETS = ("redwine", "whitewine", "parkinsons", "highdim")
PRUNE_RULES = ("reference", "greedy")
WINE_FEATURES = 11  # the physicochemical columns; the 12th, ``quality``, is dropped
PARKINSONS_FIRST_COLUMN = 3  # drop subject#, age, sex
CORRELATION_THRESHOLD = 0.98
# Parkinsons columns left by each pruning rule in the original UCI file: ``dim`` before the file is there
ORIGINAL_PARKINSONS_DIM = {"reference": 15, "greedy": 14}
MAX_HELD_OUT = 1000  # at most this many test (and val) rows
HIGHDIM_SPLITS = (4860, 540, 600)  # train, val, test rows of the synthetic Gaussian
HIGHDIM_DIM = 200  # dimension of the synthetic Gaussian unless ``dim`` says otherwise


def prune_correlated(
    data: np.ndarray, threshold: float = CORRELATION_THRESHOLD, rule: str = "reference"
) -> np.ndarray:
    """Indices (ascending) of the columns of ``data [N, D]`` kept so that no two have |correlation| > threshold.

    ``rule="reference"`` (the DKEF code): while some column has a partner above the threshold, drop the first
    such column and recompute (on Parkinsons 15 of 19 columns remain). ``rule="greedy"``: walk the columns in
    order and keep one unless it exceeds the threshold with an already kept column (14 of 19 remain).
    """
    if rule not in PRUNE_RULES:
        raise choice_error("rule", rule, PRUNE_RULES)
    with np.errstate(invalid="ignore", divide="ignore"):  # a constant column has NaN correlations: never pruned
        corr = np.abs(np.corrcoef(data, rowvar=False).reshape(data.shape[1], data.shape[1]))
    high = corr > threshold
    np.fill_diagonal(high, False)
    if rule == "greedy":
        kept: list[int] = []
        for j in range(data.shape[1]):
            if not high[j, kept].any():
                kept.append(j)
        return np.array(kept, dtype=np.int64)
    kept_arr = np.arange(data.shape[1])
    while True:
        partnered = np.flatnonzero(high[np.ix_(kept_arr, kept_arr)].any(axis=1))
        if partnered.size == 0:
            return kept_arr
        kept_arr = np.delete(kept_arr, partnered[0])


def median_gaps(data: np.ndarray) -> np.ndarray:
    """Per column of ``data [N, D]``: the median gap between sorted distinct values (0 for a constant column)."""
    gaps = [np.diff(np.unique(column)) for column in data.T]
    return np.array([np.median(g) if g.size else 0.0 for g in gaps])


def dequantize_columns(data: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """``data + U(-g/2, g/2)`` per column, ``g`` from :func:`median_gaps` (a new array)."""
    half = median_gaps(data) / 2.0
    return data + rng.uniform(-1.0, 1.0, size=data.shape) * half


def split_sizes(n: int) -> tuple[int, int, int]:
    """``(train, val, test)`` row counts: ``test = min(1000, n // 10)``, ``val = min(1000, (n - test) // 10)``."""
    test = min(MAX_HELD_OUT, n // 10)
    val = min(MAX_HELD_OUT, (n - test) // 10)
    return n - val - test, val, test


# -- the DataModule ----------------------------------------------------------------------------------------


class UCIDataModule(pl.LightningDataModule):
    """UCI density-estimation data (redwine, whitewine, parkinsons) or a synthetic Gaussian (highdim) as
    float32 vectors, served as ``(x,)`` batches; see the module docstring for the pre-processing.

    After :meth:`setup`: ``train_data``, ``val_data``, ``test_data`` (float32 ``[n, dim]``); for real data also
    ``source_columns`` (the file's columns that were whitened), ``split_rows`` (file row of every item, per
    split), ``whitening`` (a :class:`~deqscore.data.points.Whitening`: ``x = (row - mean) @ matrix + noise``, and
    back to the file's units), ``whiten_mean`` and ``whiten_matrix`` (its float64 arrays).

    Args:
        dataset: ``"redwine"``, ``"whitewine"``, ``"parkinsons"`` or ``"highdim"`` (synthetic N(0, I)).
        root: folder of the UCI files (and of downloads).
        dim: dimension of ``"highdim"`` (default 200); the real data sets' dimension is that of their file, and
            stating one for them is refused.
        batch_size: training batch size.
        eval_batch_size: val/test batch size (default ``batch_size``).
        seed: seed of the row shuffle, dequantisation, noise, synthetic data and training order.
        whiten_on: fit the PCA whitening on ``"all"`` rows (the reference, test included) or on the
            ``"train"`` rows only.
        noise_std: standard deviation of the Gaussian noise added once to the whitened real data.
        num_workers: DataLoader workers (persistent when > 0).
        prune_rule: how Parkinsons columns correlated above 0.98 are dropped: ``"reference"`` (the DKEF code,
            15 columns remain) or ``"greedy"`` (keep the earlier column of a pair, 14 remain); see
            :func:`prune_correlated`.
    """

    codec = None  # no images: nothing maps model space to pixels

    def __init__(
        self,
        dataset: Literal["redwine", "whitewine", "parkinsons", "highdim"] = "redwine",
        root: str = "datasets/uci",
        dim: int | None = None,
        batch_size: int = 200,
        eval_batch_size: int | None = None,
        seed: int = 2019,
        whiten_on: Literal["all", "train"] = "all",
        noise_std: float = 0.05,
        num_workers: int = 0,
        prune_rule: Literal["reference", "greedy"] = "reference",
    ) -> None:
        super().__init__()
        _check_options(dataset, dim, batch_size, eval_batch_size, whiten_on, noise_std, num_workers, prune_rule)
        # No save_hyperparameters(), as ImageDataModule: LightningCLI records the config.
        self.dataset = dataset  # which data set
        self.root = root  # folder of the UCI files
        self.synthetic_dim = HIGHDIM_DIM if dim is None else dim  # dimension of "highdim"
        self.batch_size = batch_size  # training batch size
        self.eval_batch_size = eval_batch_size if eval_batch_size is not None else batch_size  # val/test
        self.seed = seed  # all randomness of the data
        self.whiten_on = whiten_on  # the rows the whitening is fitted on
        self.noise_std = noise_std  # Gaussian noise added after whitening
        self.num_workers = num_workers  # DataLoader workers
        self.prune_rule = prune_rule  # Parkinsons column pruning
        self.train_data: torch.Tensor | None = None
        self.val_data: torch.Tensor | None = None
        self.test_data: torch.Tensor | None = None
        self.source_columns: list[str] | None = None
        self.split_rows: dict[str, np.ndarray] | None = None
        self.whitening: Whitening | None = None
        self._features: tuple[list[str], np.ndarray] | None = None  # (column names, values) read from the file
        self._assumed_dim: int | None = None  # ``dim`` stated before the file was there (original UCI file)

    # -- files ---------------------------------------------------------------------------------------------

    @property
    def is_synthetic(self) -> bool:
        """Whether the data are the synthetic Gaussian (known density) rather than a UCI file."""
        return self.dataset == "highdim"

    @property
    def path(self) -> Path | None:
        """Where the data set's file is read from (None for ``"highdim"``)."""
        return None if self.is_synthetic else Path(self.root) / UCI_FILES[self.dataset].name

    def _missing_message(self, reason: str) -> str:
        spec = UCI_FILES[self.dataset]
        folder = Path(self.root).resolve()
        return (
            f"UCI data set {self.dataset!r}: {spec.name} {reason}. Put the original UCI file {spec.name} "
            f"in {folder}/ (download it from {spec.url}), or run prepare_data() with internet access to "
            "download it there."
        )

    def prepare_data(self) -> None:
        """Download the data set's file into ``root`` if it is not there (Lightning calls this on one process
        per node). Raises :class:`DataNotFoundError` naming the file, the folder and the URL when that fails."""
        if self.is_synthetic or self.path.is_file():
            return
        spec = UCI_FILES[self.dataset]
        try:
            download_file(spec.url, self.path)
        except Exception as exc:  # URLError, HTTPError, socket timeouts, disk errors, ...
            reason = f"is not in {Path(self.root).resolve()} and its download failed ({type(exc).__name__}: {exc})"
            raise DataNotFoundError(self._missing_message(reason)) from exc

    def _load_features(self) -> tuple[list[str], np.ndarray]:
        """The file's feature columns (names, float64 values [N, D]), read once, never downloaded."""
        if self._features is None:
            if not self.path.is_file():
                raise DataNotFoundError(self._missing_message(f"is not in {Path(self.root).resolve()}"))
            header, table = read_uci_table(self.path, UCI_FILES[self.dataset])
            if self.dataset == "parkinsons":
                header, table = header[PARKINSONS_FIRST_COLUMN:], table[:, PARKINSONS_FIRST_COLUMN:]
                kept = prune_correlated(table, CORRELATION_THRESHOLD, self.prune_rule)
                header, table = [header[k] for k in kept], table[:, kept]
            else:
                header, table = header[:WINE_FEATURES], table[:, :WINE_FEATURES]
            if self._assumed_dim is not None and table.shape[1] != self._assumed_dim:
                raise CorruptDataError(
                    f"{self.path}: {table.shape[1]} columns remain after pruning, but dim={self._assumed_dim} "
                    "(that of the original UCI file) was stated before the file was there; restart with this file "
                    "in place so that the model is built for its dimension"
                )
            self._features = header, table
        return self._features

    @property
    def dim(self) -> int:
        """Data dimension after pre-processing. Parkinsons reads its file to know it (never downloading); before
        the file is there (``prepare_data`` not run yet) it states the dimension of the original UCI file, and
        :meth:`setup` fails if the file turns out to give another."""
        if self.is_synthetic:
            return self.synthetic_dim
        if self.dataset != "parkinsons":
            return WINE_FEATURES  # fixed by the file layout (12 columns are checked when read)
        if self._features is None and not self.path.is_file():
            self._assumed_dim = ORIGINAL_PARKINSONS_DIM[self.prune_rule]
            return self._assumed_dim
        return self._load_features()[1].shape[1]

    # -- splits --------------------------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        """Build the three splits (all at once, whatever ``stage``; never downloads)."""
        if self.train_data is not None:
            return
        splits = self._synthetic_splits() if self.is_synthetic else self._real_splits()
        self.train_data, self.val_data, self.test_data = (torch.from_numpy(s.astype(np.float32)) for s in splits)

    def _synthetic_splits(self) -> list[np.ndarray]:
        data = np.random.RandomState(self.seed).standard_normal((sum(HIGHDIM_SPLITS), self.synthetic_dim))
        return np.split(data, np.cumsum(HIGHDIM_SPLITS)[:-1])

    def _real_splits(self) -> list[np.ndarray]:
        names, table = self._load_features()
        rng = np.random.RandomState(self.seed)
        order = rng.permutation(len(table))
        data = table[order]
        if self.dataset in ("redwine", "whitewine"):
            data = dequantize_columns(data, rng)
        n_train, n_val, _ = split_sizes(len(data))
        fit_rows = data[:n_train] if self.whiten_on == "train" else data
        self.whitening = Whitening.fit(fit_rows, names)
        data = self.whitening.to_model(data)
        data = data + rng.standard_normal(data.shape) * self.noise_std
        bounds = [n_train, n_train + n_val]
        self.source_columns = list(names)
        self.split_rows = dict(zip(("train", "val", "test"), np.split(order, bounds), strict=True))
        return np.split(data, bounds)

    @property
    def whiten_mean(self) -> np.ndarray | None:
        return None if self.whitening is None else self.whitening.mean

    @property
    def whiten_matrix(self) -> np.ndarray | None:
        return None if self.whitening is None else self.whitening.matrix

    @property
    def log_det_whitening(self) -> float:
        """``log |det W|`` of the whitening ``x = (row - mean) @ W`` (0 for synthetic data): a log-density of the
        whitened data plus this is the log-density of the rows in the data's own units (after pruning and
        dequantisation; the small noise added after whitening is not undone)."""
        return 0.0 if self.whitening is None else self.whitening.log_det

    @property
    def source_options(self) -> dict[str, object]:
        """The options that rebuild the same splits (a checkpoint keeps them: ``sample.py`` plots samples against
        the held-out rows)."""
        options = {"dataset": self.dataset, "root": str(self.root), "seed": self.seed, "whiten_on": self.whiten_on,
                   "noise_std": self.noise_std, "prune_rule": self.prune_rule}
        return options | ({"dim": self.synthetic_dim} if self.is_synthetic else {})

    def train_subset(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` distinct random training rows ``[n, dim]`` drawn with ``generator`` (e.g. to refresh a model's
        coefficients)."""
        data = self._split(self.train_data, "train")
        if not 0 <= n <= len(data):
            raise ValueError(f"train_subset: n must lie in [0, {len(data)}] (the training rows), got {n}")
        return data[torch.randperm(len(data), generator=generator)[:n]]

    # -- known density (highdim) ---------------------------------------------------------------------------

    def true_log_prob(self, x: torch.Tensor) -> torch.Tensor | None:
        """Log density ``[B]`` of the data distribution N(0, I) at ``x [B, dim]`` for ``"highdim"``; None for
        real data (unknown)."""
        if not self.is_synthetic:
            return None
        self._check_points(x)
        return -0.5 * (x * x).sum(dim=-1) - 0.5 * self.synthetic_dim * math.log(2.0 * math.pi)

    def true_score(self, x: torch.Tensor) -> torch.Tensor | None:
        """Score ``grad_x log p(x) = -x`` ``[B, dim]`` of N(0, I) for ``"highdim"``; None for real data."""
        if not self.is_synthetic:
            return None
        self._check_points(x)
        return -x

    def _check_points(self, x: torch.Tensor) -> None:
        if x.ndim != 2 or x.shape[1] != self.synthetic_dim:
            raise ValueError(f"expected points of shape [B, {self.synthetic_dim}], got {tuple(x.shape)}")

    # -- loaders -------------------------------------------------------------------------------------------

    @staticmethod
    def _split(data: torch.Tensor | None, name: str) -> torch.Tensor:
        if data is None:
            raise RuntimeError(f"the {name} split is not built; call setup() first")
        return data

    def _loader(self, data: torch.Tensor | None, name: str, batch_size: int, train: bool) -> DataLoader:
        data = self._split(data, name)
        # keep a lone incomplete batch rather than none
        return epoch_loader(TensorDataset(data), batch_size, train, self.seed, self.num_workers,
                            drop_last=train and len(data) >= batch_size)

    def train_dataloader(self) -> DataLoader:
        """Training batches ``(x [B, dim],)`` in a per-epoch seeded order; an incomplete last batch is dropped
        when there is at least one full batch."""
        return self._loader(self.train_data, "train", self.batch_size, train=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches ``(x,)`` in order."""
        return self._loader(self.val_data, "val", self.eval_batch_size, train=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches ``(x,)`` in order."""
        return self._loader(self.test_data, "test", self.eval_batch_size, train=False)

    def predict_dataloader(self) -> DataLoader:
        """Same as :meth:`test_dataloader`."""
        return self.test_dataloader()


def _check_options(
    dataset: str,
    dim: int | None,
    batch_size: int,
    eval_batch_size: int | None,
    whiten_on: str,
    noise_std: float,
    num_workers: int,
    prune_rule: str,
) -> None:
    if dataset not in DATASETS:
        raise choice_error("dataset", dataset, DATASETS)
    if whiten_on not in ("all", "train"):
        raise choice_error("whiten_on", whiten_on, ("all", "train"))
    if prune_rule not in PRUNE_RULES:
        raise choice_error("prune_rule", prune_rule, PRUNE_RULES)
    if dim is not None:
        check_count("dim", dim)
        if dataset != "highdim":
            raise ConfigError(f"dim: only the synthetic data set 'highdim' takes a dimension; {dataset!r} has that of "
                              "its file: leave dim unset (a run's config.yaml from before dim was refused here holds "
                              "dim: 200 under data.init_args: delete that line)", key="dim")
    check_count("batch_size", batch_size)
    if eval_batch_size is not None:
        check_count("eval_batch_size", eval_batch_size)
    check_count("num_workers", num_workers, low=0)
    if isinstance(noise_std, bool) or not isinstance(noise_std, (int, float)) or not math.isfinite(noise_std):
        raise ConfigError(f"noise_std must be a finite number >= 0, got {noise_std!r}", key="noise_std")
    if noise_std < 0:
        raise ConfigError(f"noise_std must be >= 0, got {noise_std}", key="noise_std")
