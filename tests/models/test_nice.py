import math
from functools import partial

import pytest
import torch

from deqscore.deq import DEQ
from deqscore.errors import ConfigError
from deqscore.losses import score_from_log_prob, sliced_score_matching
from deqscore.models import NICE

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


def test_samples_follow_model_density_for_pure_scale_flow():
    flow = NICE(dim=4, n_couplings=0).double()
    with torch.no_grad():
        flow.log_scale.copy_(torch.tensor([0.0, 0.5, -0.5, 1.0]))
    x = flow.sample(20000)
    assert torch.allclose(x.std(0), torch.exp(-flow.log_scale.detach()), rtol=0.03)


def test_bad_config_raises():
    with pytest.raises(ConfigError, match="unknown NICE m_net 'resnet'; accepted: 'explicit', 'deq'"):
        NICE(m_net="resnet")
    with pytest.raises(ConfigError, match="even"):
        NICE(dim=7)
    with pytest.raises(ConfigError, match="n_couplings >= 0"):
        NICE(n_couplings=-1)
