"""The study's judgement: the Student t distribution against tabulated values, the non-inferiority rule on known
cases and by simulation against the rule it replaced, the protocol-version check, and the DEQ trust figures against
closed forms of a linear map."""

import json
import math
import random
import shutil

import pytest
import torch
from torch import nn

from deqlab.study import protocol as protocol_module
from deqlab.study.tables import reference_solve
from deqlab.study.trust import derivative_error, spectral_radius, trust_figures
from deqlab.study.verdict import holm, incomplete_beta, non_inferiority, power, seeds_needed, t_cdf, t_quantile
from deqscore.deq import DEQ

# (p, degrees of freedom, quantile) from standard t tables
T_TABLE = [(0.95, 1, 6.313752), (0.95, 2, 2.919986), (0.95, 4, 2.131847), (0.95, 8, 1.859548),
           (0.975, 10, 2.228139), (0.8, 3, 0.978472), (0.99, 30, 2.457262), (0.95, 1e7, 1.644854)]


@pytest.mark.parametrize("p, nu, quantile", T_TABLE)
def test_t_quantiles_match_the_tables(p, nu, quantile):
    assert t_quantile(p, nu) == pytest.approx(quantile, abs=2e-6)
    assert t_cdf(quantile, nu) == pytest.approx(p, abs=1e-6)
    assert t_quantile(1 - p, nu) == pytest.approx(-quantile, abs=2e-6)


def test_incomplete_beta_closed_forms():
    for x in (0.1, 0.5, 0.93):
        assert incomplete_beta(1.0, 1.0, x) == pytest.approx(x, abs=1e-12)  # uniform
        assert incomplete_beta(2.0, 1.0, x) == pytest.approx(x**2, abs=1e-12)
        assert incomplete_beta(0.5, 0.5, x) == pytest.approx(2 / math.pi * math.asin(math.sqrt(x)), abs=1e-10)


def test_t_cdf_at_one_degree_of_freedom_is_the_cauchy():
    for t in (-3.0, -0.4, 0.0, 1.7, 25.0):
        assert t_cdf(t, 1.0) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-10)


def test_the_three_verdicts_and_their_bounds():
    """Lower is better (bits/dim): the DEQ's d is the shallow mean minus its own."""
    shallow = [5.0, 5.2, 5.4]  # sd 0.2
    holds = non_inferiority([5.0, 5.1, 5.2], shallow, margin=0.5, higher_is_better=False)
    se = math.sqrt(0.2**2 / 3 + 0.1**2 / 3)
    df = se**4 / ((0.04 / 3) ** 2 / 2 + (0.01 / 3) ** 2 / 2)  # Welch-Satterthwaite by hand
    assert holds.d == pytest.approx(0.1) and holds.se == pytest.approx(se) and holds.df == pytest.approx(df)
    assert holds.lower == pytest.approx(0.1 - t_quantile(0.95, df) * se)
    assert holds.verdict == "holds" and holds.supported_margin == pytest.approx(-holds.lower)
    fails = non_inferiority([6.0, 6.1, 6.2], shallow, margin=0.5, higher_is_better=False)
    assert fails.upper < -0.5 and fails.verdict == "fails" and fails.seeds_needed is None
    unsure = non_inferiority([5.3, 5.6, 5.9], shallow, margin=0.5, higher_is_better=False)
    assert unsure.lower < -0.5 < unsure.upper and unsure.verdict == "inconclusive" and unsure.seeds_needed > 3
    # higher is better flips the sign
    assert non_inferiority([2.0, 2.1], [1.0, 1.1], 0.1, higher_is_better=True).d == pytest.approx(1.0)
    assert non_inferiority([2.0], [1.0, 1.1], 0.1, True) is None  # one seed: no test


def test_seeds_needed_reaches_the_power_it_promises():
    """At the returned n, the test holds with probability about 0.8 when the two are equal (simulated), and not at
    n - 1 by the same formula."""
    sd, margin = 0.1, 0.15
    n = seeds_needed(sd, sd, margin)
    rng = random.Random(0)
    trials = 1500
    held = sum(non_inferiority([rng.gauss(0, sd) for _ in range(n)], [rng.gauss(0, sd) for _ in range(n)], margin,
                               True).verdict == "holds" for _ in range(trials))
    assert 0.75 < held / trials < 0.9
    assert seeds_needed(sd, sd, margin / 2) > n  # a tighter margin needs more seeds


def test_noise_no_longer_passes():
    """The DEQ truly worse by 0.1 with noisy seeds (sd 0.5): v1's rule ('better, or worse by less than one standard
    error') said 'holds' most of the time; the non-inferiority test at margin 0.05 says so about 5 % of the time at
    most, and is mostly inconclusive."""
    rng = random.Random(1)
    old = new = inconclusive = 0
    trials = 2000
    for _ in range(trials):
        deq, shallow = [rng.gauss(-0.1, 0.5) for _ in range(3)], [rng.gauss(0.0, 0.5) for _ in range(3)]
        d = sum(deq) / 3 - sum(shallow) / 3
        se = math.sqrt(sum((v - sum(deq) / 3) ** 2 for v in deq) / 6 + sum((v - sum(shallow) / 3) ** 2
                                                                             for v in shallow) / 6)
        old += d >= 0 or d >= -se
        test = non_inferiority(deq, shallow, 0.05, True)
        new += test.verdict == "holds"
        inconclusive += test.verdict == "inconclusive"
    assert old / trials > 0.6 and new / trials < 0.06 and inconclusive / trials > 0.9


# -------------------------------------------------------------------------------------------------- protocol
def test_a_protocol_names_its_version_and_refuses_foreign_units(tmp_path):
    protocol = protocol_module.load()
    assert protocol.path == protocol_module.newest() and protocol.path.name == f"v{protocol.version}.json"
    unit = {"family": "nice", "group": "mnist", "variant": "deq", "seed": 0, "settings": {"protocol": protocol.stamp}}
    protocol_module.check_units(protocol, [unit])
    edited = unit | {"settings": {"protocol": {"version": protocol.version, "sha256": "0" * 64}}}
    with pytest.raises(protocol_module.ProtocolError, match=f"not recorded under protocol v{protocol.version}"):
        protocol_module.check_units(protocol, [unit, edited])
    with pytest.raises(protocol_module.ProtocolError, match="no protocol"):
        protocol_module.check_units(protocol, [unit | {"settings": {}}])
    renamed = tmp_path / f"v{protocol.version + 1}.json"
    shutil.copyfile(protocol.path, renamed)
    misnamed = f"holds version {protocol.version}; a protocol is named v<version>.json"
    with pytest.raises(protocol_module.ProtocolError, match=misnamed):
        protocol_module.load(renamed)
    assert protocol_module.newest(tmp_path) == renamed
    later = json.loads(protocol.path.read_text()) | {"version": protocol.version + 1}
    renamed.write_text(json.dumps(later))
    assert protocol_module.load(renamed).stamp != protocol.stamp


def test_the_protocol_covers_every_family_and_variant():
    from deqlab.study.families import families

    protocol = protocol_module.load()
    for name, family in families().items():
        entry = protocol.family(name)
        assert entry["higher_is_better"] == family.judged(protocol).higher_is_better
        assert family.control(protocol).key in {m.key for m in family.metrics}
        assert set(entry["seeds"]) <= set(family.variants)
        assert {"shallow", "deq"} <= {family.variants[v].role for v in entry["seeds"]}
        assert protocol.seeds(name, "explicit") == list(range(5)) and protocol.seeds(name, "deq") == list(range(5))
    assert protocol.margin("ncsn", 400.0) == pytest.approx(8.0) and protocol.margin("nice") == 0.05


# ----------------------------------------------------------------------------------------------------- trust
class ScaledMap(nn.Module):
    """``f(z, u) = a z + u``: the Jacobian is ``a I``, the implicit derivative ``1 / (1 - a)``."""

    def __init__(self, a: float):
        super().__init__()
        self.a = a

    def forward(self, z, u):
        return self.a * z + u


class LinearModule(nn.Module):
    """A stand-in for a ScoreModule: ``loss = mean |DEQ(lin(x))|^2`` with the scaled map."""

    deq_objective = "loss"

    def __init__(self, a: float, steps: int, solver: str = "picard"):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.deq = DEQ(ScaledMap(a), solver=solver, tol=1e-12, max_iter=2000, phantom_steps=steps)

    def deq_layers(self):
        return [self.deq]

    def loss_terms(self, x):
        return {"loss": self.deq(self.lin(x)).pow(2).sum(1).mean()}


@pytest.mark.parametrize("a, steps", [(0.5, 2), (0.8, 3), (0.3, 8)])
def test_trust_figures_of_a_linear_map_are_its_closed_forms(a, steps):
    torch.manual_seed(0)
    module = LinearModule(a, steps).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    figures = trust_figures(module, x)
    # K phantom steps from the fixed point give sum_{k<K} a^k of 1 / (1 - a): relative error a^K
    assert figures["contraction"] == pytest.approx(a, rel=1e-9)
    assert figures["neumann_remainder"] == pytest.approx(a**steps, rel=1e-8)
    assert figures["derivative_rel_error"] == pytest.approx(a**steps, rel=1e-6)
    assert figures["gradient_rel_error"] == pytest.approx(a**steps, rel=1e-6)
    assert figures["objective_rel_error"] < 1e-9  # the value is the fixed point's either way
    assert figures["capped_solves"] == 0.0 and figures["exact_converged"]
    assert figures["exact_reference"] == "unroll"


@pytest.mark.parametrize("a, steps", [(-1.5, 2), (1.4, 3)])
def test_past_a_contraction_of_one_the_reference_is_the_implicit_derivative_by_the_layers_solver(a, steps):
    """|a| > 1: unrolled Picard diverges, Anderson finds z* = u / (1 - a) and the derivative 1 / (1 - a); K phantom
    steps give sum_{k<K} a^k of it, a relative error |a|^K (above 1)."""
    torch.manual_seed(0)
    module = LinearModule(a, steps, solver="anderson").double()
    x = torch.randn(6, 3, dtype=torch.float64)
    figures = trust_figures(module, x)
    assert figures["exact_reference"] == "implicit" and figures["exact_converged"]
    assert figures["contraction"] == pytest.approx(abs(a), rel=1e-9)
    assert figures["derivative_rel_error"] == pytest.approx(abs(a) ** steps, rel=1e-6)
    assert figures["gradient_rel_error"] == pytest.approx(abs(a) ** steps, rel=1e-6)
    assert figures["objective_rel_error"] < 1e-9


def test_the_reference_solve_cell_counts_the_implicit_references():
    figures = [{"exact_converged": True, "exact_reference": "implicit"}, {"exact_converged": True},
               {"exact_converged": False, "exact_at_floor": True, "exact_reference": "unroll"}]
    assert reference_solve(figures) == ("2 of 3 converged, 1 by the implicit derivative (the unrolled solve "
                                        "diverged), 1 at float32's floor")


def test_power_iteration_finds_the_largest_eigenvalue_per_sample():
    layer = DEQ(ScaledMap(0.0))
    weights = torch.tensor([[0.2, 0.9, 0.1], [0.5, 0.4, 0.45]])

    class Diagonal(nn.Module):
        def forward(self, z, u):
            return weights * z + u

    layer.func = Diagonal()
    z = torch.zeros(2, 3)
    assert spectral_radius(layer, z, z, iterations=200).tolist() == pytest.approx([0.9, 0.5], rel=1e-3)
    assert derivative_error(layer, z, z) > 0.1  # two steps on a 0.9 contraction miss much of the series


# ------------------------------------------------------------------------------------------------ multiplicity
def test_holm_steps_down_and_stops_at_the_first_larger_p_value():
    """Holm at alpha 0.05 over m = 4: thresholds 0.0125, 0.0167, 0.025, 0.05. p = (0.01, 0.015, 0.03, 0.04) rejects
    the first two and stops at 0.03 > 0.025, though 0.04 < 0.05; a family of 8 (four comparisons without units
    yet) rejects only p below 0.05 / 8 (0.005); None is never rejected."""
    assert holm([0.03, 0.01, 0.04, 0.015], 4) == [False, True, False, True]
    assert holm([0.03, 0.005, 0.04, 0.015], 8) == [False, True, False, False]
    assert holm([0.001, None], 2) == [True, False]
    assert holm([0.049], 1) == [True] and holm([0.049], 2) == [False]
    with pytest.raises(ValueError, match="2 p-values in a family of 1"):
        holm([0.1, 0.2], 1)


def test_a_holds_before_holm_can_fall_after_it(tmp_path):
    """A hand-made family: one comparison that holds alone (p just under 0.05) is inconclusive when judged with
    the 18 comparisons DKEF's protocol defines; a clear one holds either way."""
    from deqlab.study.judging import apply_holm

    clear = non_inferiority([0.0, 0.01, -0.01, 0.005, -0.005], [0.0, 0.01, -0.01, 0.005, -0.005], 0.1, True)
    marginal = non_inferiority([-0.05, 0.05, 0.0, -0.1, 0.1], [0.0, 0.01, -0.01, 0.005, -0.005], 0.1, True)
    assert clear.verdict == marginal.verdict == "holds" and 0.01 < marginal.p_holds < 0.05
    comparisons = [{"test": clear}, {"test": marginal}]
    apply_holm(comparisons, 2)
    assert [c["holm"] for c in comparisons] == ["holds", "holds"]
    apply_holm(comparisons, 18)
    assert [c["holm"] for c in comparisons] == ["holds", "inconclusive"]


def test_p_values_agree_with_the_bounds_and_power_with_simulation():
    """p_holds < alpha exactly when L > -margin; the power at equality matches the share of simulated equal arms
    that hold (shifted-t approximation, 4,000 trials)."""
    for deq in ([1.0, 1.1, 0.9], [0.5, 0.9, 0.7], [0.0, 0.3, -0.2, 0.1]):
        test = non_inferiority(deq, [1.0, 1.05, 0.95], 0.2, True)
        assert (test.p_holds < 0.05) == (test.lower > -0.2)
        assert (test.p_fails < 0.05) == (test.upper < -0.2)
    rng, n, sd, margin = random.Random(3), 6, 1.0, 1.2
    held = 0
    for _ in range(4000):
        a, b = ([rng.gauss(0, sd) for _ in range(n)] for _ in range(2))
        held += non_inferiority(a, b, margin, True).verdict == "holds"
    se, df = math.sqrt(2 * sd**2 / n), 2 * n - 2
    assert power(se, df, margin, 0.0) == pytest.approx(held / 4000, abs=0.04)
    assert power(se, df, margin, -margin) == pytest.approx(0.05, abs=1e-9)  # at the margin: alpha
