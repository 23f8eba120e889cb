import math
from functools import partial

import pytest
import torch

from deqscore.deq import DEQ
from deqscore.errors import ConfigError
from deqscore.losses import score_from_log_prob, sliced_score_matching
from deqscore.models import NICE
from deqscore.models.nice import explicit_mlp

VARIANTS = [("explicit", 2), ("explicit", 4), ("deq", 2), ("deq", 4)]


def _flow(m_net, n_couplings, dim=8):
    torch.manual_seed(0)
    flow = NICE(dim=dim, n_couplings=n_couplings, m_net=m_net, hidden=6, n_layers=3,
                deq=partial(DEQ, tol=1e-12, max_iter=300)).double()
    with torch.no_grad():
        flow.log_scale.normal_(0, 0.3)
    return flow


@pytest.mark.parametrize(("m_net", "n_couplings"), VARIANTS)
def test_inverse_undoes_forward(m_net, n_couplings):
    flow = _flow(m_net, n_couplings)
    x = torch.randn(5, 8, dtype=torch.float64)
    assert torch.allclose(flow.inverse(flow(x)), x, atol=1e-9)
    y = torch.randn(5, 8, dtype=torch.float64)
    assert torch.allclose(flow(flow.inverse(y)), y, atol=1e-9)


@pytest.mark.parametrize(("m_net", "n_couplings"), VARIANTS)
def test_log_prob_is_change_of_variables(m_net, n_couplings):
    flow = _flow(m_net, n_couplings)
    x = torch.randn(3, 8, dtype=torch.float64)
    for b in range(3):
        jac = torch.autograd.functional.jacobian(lambda v: flow(v[None])[0], x[b])
        y = flow(x[b : b + 1])[0]
        expected = -0.5 * y.pow(2).sum() - 4 * math.log(2 * math.pi) + torch.linalg.slogdet(jac)[1]
        assert flow.log_prob(x[b : b + 1])[0].item() == pytest.approx(expected.item(), abs=1e-8)


@pytest.mark.parametrize(("m_net", "n_couplings"), VARIANTS)
def test_every_parameter_is_used_and_trained_by_ssm(m_net, n_couplings):
    flow = _flow(m_net, n_couplings)
    x = torch.randn(6, 8, dtype=torch.float64)
    sliced_score_matching(score_from_log_prob(flow.log_prob), x).mean().backward()
    for name, p in flow.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    n_deq = sum(isinstance(m, DEQ) for m in flow.modules())
    assert n_deq == (n_couplings if m_net == "deq" else 0)
    assert len(flow.m_nets) == n_couplings


def test_paper_sizes_parameter_counts():
    # docs/method.md section 4.1: per coupling 3,788,392 (explicit, 5 layers of width 1000) and 2,787,392 (DEQ)
    for m_net, per_coupling in (("explicit", 3_788_392), ("deq", 2_787_392)):
        flow = NICE(m_net=m_net, n_couplings=2)
        assert sum(p.numel() for p in flow.m_nets[0].parameters()) == per_coupling
        assert sum(p.numel() for p in flow.parameters()) == 2 * per_coupling + 784


def test_deq_map_is_a_contraction():
    flow = NICE(dim=8, m_net="deq", hidden=16, n_couplings=1, deq_scale=0.5).double()
    fmap = flow.m_nets[0].deq.func
    with torch.no_grad():
        fmap.lin1.weight.mul_(50.0)  # the normaliser must undo any weight scale
        u = torch.randn(64, 16, dtype=torch.float64)
        z1, z2 = torch.randn(64, 16, dtype=torch.float64), torch.randn(64, 16, dtype=torch.float64)
        ratio = (fmap(z1, u) - fmap(z2, u)).norm(dim=1) / (z1 - z2).norm(dim=1)
    assert ratio.max() < 0.5


def _pure_scale_flow(dim: int = 4) -> NICE:
    """One coupling whose m-net's last Linear layer is zero, so the coupling adds nothing: y = exp(s) * x."""
    flow = NICE(dim=dim, n_couplings=1, hidden=5, n_layers=2).double()
    with torch.no_grad():
        flow.m_nets[0][-1].weight.zero_()
        flow.m_nets[0][-1].bias.zero_()
    return flow


def test_samples_follow_model_density_for_pure_scale_flow():
    flow = _pure_scale_flow()
    with torch.no_grad():
        flow.log_scale.copy_(torch.tensor([0.0, 0.5, -0.5, 1.0]))
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(flow(x), x * torch.exp(flow.log_scale))  # the coupling is the identity
    x = flow.sample(20000)
    assert torch.allclose(x.std(0), torch.exp(-flow.log_scale.detach()), rtol=0.03)


def test_bad_config_raises():
    with pytest.raises(ConfigError, match="unknown NICE m_net 'resnet'; accepted: 'explicit', 'deq'"):
        NICE(m_net="resnet")


BAD_OPTIONS = [  # (option, value, what the message must say)
    ("dim", 7, "NICE dim must be even"),
    ("dim", 0, "NICE dim must be >= 2"),
    ("dim", 8.0, "NICE dim must be an int"),
    ("n_couplings", 0, "NICE n_couplings must be >= 1, got 0: without couplings"),
    ("n_couplings", -1, "NICE n_couplings must be >= 1"),
    ("n_couplings", True, "NICE n_couplings must be an int"),
    ("hidden", 0, "NICE hidden must be >= 1, got 0"),
    ("hidden", -3, "NICE hidden must be >= 1"),
    ("hidden", 2.5, "NICE hidden must be an int"),
    ("n_layers", 1, "n_layers must be >= 2, got 1"),
    ("n_layers", 3.0, "n_layers must be an int"),
    ("deq_scale", float("nan"), "NICE deq_scale must be finite, got nan"),
    ("deq_scale", float("inf"), "NICE deq_scale must be finite, got inf"),
    ("deq_scale", 1.0, r"NICE deq_scale must lie in \(0, 1\), got 1.0"),
    ("deq_scale", 0.0, "NICE deq_scale must be positive"),
]


@pytest.mark.parametrize(
    ("m_net", "option", "value", "message"),
    [(m, *bad) for m in ("explicit", "deq") for bad in BAD_OPTIONS if m == "explicit" or bad[0] != "n_layers"],
)
def test_bad_option_raises_config_error_naming_it(m_net, option, value, message):
    with pytest.raises(ConfigError, match=message):
        NICE(**{"dim": 4, "n_couplings": 1, "hidden": 3, "m_net": m_net, option: value})


def test_explicit_mlp_checks_its_sizes():
    with pytest.raises(ConfigError, match="n_layers must be >= 2"):
        explicit_mlp(2, 3, 1, 2)
    with pytest.raises(ConfigError, match="hidden must be >= 1"):
        explicit_mlp(2, 0, 3, 2)


def _nonfinite(n_bad: int, dim: int = 4) -> torch.Tensor:
    x = torch.randn(3, dim, dtype=torch.float64)
    x.view(-1)[:n_bad] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)[:n_bad]
    return x


@pytest.mark.parametrize("method", ["forward", "inverse", "log_prob"])
@pytest.mark.parametrize("m_net", ["explicit", "deq"])
@pytest.mark.parametrize("n_bad", [1, 3])
def test_nonfinite_input_is_reported_as_such_not_as_a_diverging_solver(m_net, method, n_bad):
    flow = NICE(dim=4, n_couplings=2, hidden=3, n_layers=2, m_net=m_net).double()
    with pytest.raises(ValueError, match=f"the input to NICE contains {n_bad} non-finite values"):
        getattr(flow, method)(_nonfinite(n_bad))


@pytest.mark.parametrize("method", ["forward", "inverse", "log_prob"])
def test_input_of_the_wrong_shape_raises(method):
    flow = NICE(dim=4, n_couplings=1, hidden=3, n_layers=2).double()
    with pytest.raises(ValueError, match=r"NICE expects inputs of shape \[B, 4\], got \(3, 6\)"):
        getattr(flow, method)(torch.randn(3, 6, dtype=torch.float64))


def test_finiteness_is_checked_once_per_call_not_per_coupling(monkeypatch):
    flow = NICE(dim=4, n_couplings=4, hidden=3, n_layers=2).double()
    calls = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(t.shape) or isfinite(t))
    x = torch.randn(3, 4, dtype=torch.float64)
    for method in (flow.forward, flow.inverse, flow.log_prob):
        calls.clear()
        method(x)
        assert len(calls) == 1, method.__name__
    calls.clear()
    flow.sample(5)  # drawn from N(0, I): nothing to check
    assert not calls


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_sample_refuses_a_nonfinite_temperature(temperature):
    flow = NICE(dim=4, n_couplings=1, hidden=3, n_layers=2)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        flow.sample(2, temperature=temperature)
