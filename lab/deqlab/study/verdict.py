"""The study's verdict: a one-sided non-inferiority test of the DEQ against an explicit network, by Welch's t.

With ``d`` the DEQ's mean minus the other network's, signed so that positive means the DEQ is better, ``se`` its
standard error and ``nu`` Welch's degrees of freedom, the one-sided ``1 - alpha`` bounds are
``L = d - t(1 - alpha, nu) se`` and ``U = d + t(1 - alpha, nu) se``. At the protocol's margin ``delta``:

* **holds** when ``L > -delta`` (the DEQ is worse by less than ``delta``, at the stated confidence);
* **fails** when ``U < -delta`` (it is worse by more than ``delta``);
* **inconclusive** otherwise: the data cannot tell, and :func:`seeds_needed` says how many seeds per arm would.

``-L`` is the smallest margin the data support. Unlike "better, or worse by less than one standard error", a
noisier comparison makes this test harder to pass, not easier.

The Student t distribution is computed here (the regularised incomplete beta function by its continued fraction)
so that the verdict needs nothing beyond the standard library.

>>> round(t_quantile(0.95, 4), 4), round(t_quantile(0.975, 10), 4)
(2.1318, 2.2281)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..units import mean_stderr

ALPHA = 0.05  # one-sided: 95 % bounds
POWER = 0.8  # of the seeds-per-arm calculation
MAX_SEEDS = 1000  # seeds_needed stops looking here


def _incomplete_beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz), for ``x`` below
    ``(a + 1) / (a + b + 2)`` where it converges fast."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _incomplete_beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _incomplete_beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, nu: float) -> float:
    """P(T <= t) for Student's t with ``nu`` (real, > 0) degrees of freedom."""
    tail = 0.5 * incomplete_beta(nu / 2.0, 0.5, nu / (nu + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, nu: float) -> float:
    """The ``p`` quantile of Student's t with ``nu`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0 or not nu > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and nu > 0, got p={p}, nu={nu}")
    if p < 0.5:
        return -t_quantile(1.0 - p, nu)
    low, high = 0.0, 1.0
    while t_cdf(high, nu) < p:
        high *= 2.0
    for _ in range(64):  # the bracket's width times 2^-64: below double precision
        mid = 0.5 * (low + high)
        low, high = (mid, high) if t_cdf(mid, nu) < p else (low, mid)
    return 0.5 * (low + high)


def welch(sd_a: float, n_a: int, sd_b: float, n_b: int) -> tuple[float, float]:
    """The standard error of a difference of two means and Welch-Satterthwaite's degrees of freedom."""
    va, vb = sd_a**2 / n_a, sd_b**2 / n_b
    se = math.sqrt(va + vb)
    if se == 0.0:
        return 0.0, float(n_a + n_b - 2)
    return se, (va + vb) ** 2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1))


@dataclass(frozen=True)
class NonInferiority:
    """One comparison under the rule of the module docstring (``d`` positive: the DEQ is better)."""

    d: float
    se: float
    df: float
    lower: float  # L
    upper: float  # U
    margin: float  # delta, fixed by the protocol
    verdict: str  # "holds", "fails" or "inconclusive"
    n: tuple[int, int]  # seeds of the DEQ and of the other network
    sd: tuple[float, float]  # their per-seed standard deviations

    @property
    def supported_margin(self) -> float:
        """The smallest margin at which the comparison would hold: ``-L``."""
        return -self.lower

    @property
    def seeds_needed(self) -> int | None:
        """Per arm, for an inconclusive comparison (:func:`seeds_needed`); None otherwise or beyond the search."""
        return seeds_needed(*self.sd, self.margin) if self.verdict == "inconclusive" else None


def non_inferiority(deq: list[float], other: list[float], margin: float, higher_is_better: bool,
                    alpha: float = ALPHA) -> NonInferiority | None:
    """The DEQ's per-seed metrics against the other network's at ``margin``; None with fewer than two seeds on a
    side (no standard deviation, nothing to test)."""
    if len(deq) < 2 or len(other) < 2:
        return None
    if not margin > 0:
        raise ValueError(f"a non-inferiority margin must be positive, got {margin}")
    sign = 1.0 if higher_is_better else -1.0
    (mean_deq, se_deq), (mean_other, se_other) = mean_stderr(deq), mean_stderr(other)
    d = sign * (mean_deq - mean_other)
    sd_deq, sd_other = se_deq * math.sqrt(len(deq)), se_other * math.sqrt(len(other))
    se, df = welch(sd_deq, len(deq), sd_other, len(other))
    t = t_quantile(1.0 - alpha, df)
    lower, upper = d - t * se, d + t * se
    verdict = "holds" if lower > -margin else "fails" if upper < -margin else "inconclusive"
    return NonInferiority(d, se, df, lower, upper, margin, verdict, (len(deq), len(other)), (sd_deq, sd_other))


def seeds_needed(sd_a: float, sd_b: float, margin: float, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Seeds per arm for the test to hold with probability ``power`` when the two networks are truly equal and
    their per-seed standard deviations are ``sd_a`` and ``sd_b``: the smallest ``n`` with
    ``(t(1 - alpha, nu) + t(power, nu)) sqrt((sd_a^2 + sd_b^2) / n) <= margin`` (Welch's ``nu`` at ``n`` per arm);
    None beyond :data:`MAX_SEEDS`."""
    for n in range(2, MAX_SEEDS + 1):
        se, df = welch(sd_a, n, sd_b, n)
        if (t_quantile(1.0 - alpha, df) + t_quantile(power, df)) * se <= margin:
            return n
    return None
