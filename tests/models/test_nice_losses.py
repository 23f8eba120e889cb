import pytest
import torch

from deqscore.losses import exact_score_matching, score_from_log_prob
from deqscore.models.nice import NICE
from deqscore.models.nice_losses import (
    curvature_propagation_backprop,
    curvature_propagation_score_matching,
    kingma_backprop,
    kingma_score_matching,
)

D = 6


def _flow(seed: int = 0, n_couplings: int = 3, hidden: int = 5, n_layers: int = 3) -> NICE:
    """A random flow; ``n_couplings=0`` gives a pure scale flow (NICE needs >= 1 coupling: one whose m-net's
    last Linear layer is zero, so it adds nothing)."""
    torch.manual_seed(seed)
    flow = NICE(dim=D, n_couplings=max(n_couplings, 1), hidden=hidden, n_layers=n_layers).double()
    with torch.no_grad():
        flow.log_scale.copy_(0.5 * torch.randn(D, dtype=torch.float64))
        for p in flow.m_nets.parameters():  # larger weights: strong curvature and coupling cross terms
            p.mul_(2.0)
        if n_couplings == 0:
            flow.m_nets[0][-1].weight.zero_()
            flow.m_nets[0][-1].bias.zero_()
    return flow


def _x(b: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _exact_score_and_hessian_diag(flow: NICE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(flow.log_prob(x).sum(), x, create_graph=True)
    # samples are independent, so d(sum_b g[b, d]) / dx[b, d] is the per-sample diagonal entry
    diag = torch.stack([torch.autograd.grad(g[:, d].sum(), x, retain_graph=True)[0][:, d] for d in range(D)], 1)
    return g.detach(), diag.detach()


@pytest.mark.parametrize("n_couplings", [0, 1, 2, 3])
def test_g1_is_the_exact_score(n_couplings):
    flow, x = _flow(n_couplings=n_couplings), _x()
    score, _ = _exact_score_and_hessian_diag(flow, x)
    g1_k, _ = kingma_backprop(flow, x)
    g1_cp, _, _ = curvature_propagation_backprop(flow, x)
    assert torch.allclose(g1_k, score, rtol=1e-10, atol=1e-10)
    assert torch.allclose(g1_cp, score, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("n_couplings", "n_layers"), [(0, 3), (1, 2), (1, 4)])
def test_kingma_g2_exact_where_every_hessian_is_diagonal_or_1x1(n_couplings, n_layers):
    # one coupling: the output Hessian is diagonal and there are no even/odd cross terms yet; hidden width 1:
    # every Hessian inside the m-net is 1x1 or W^T h W with scalar h, whose diagonal (W*W)^T h is exact
    flow, x = _flow(n_couplings=n_couplings, hidden=1, n_layers=n_layers), _x()
    score, diag = _exact_score_and_hessian_diag(flow, x)
    _, g2 = kingma_backprop(flow, x)
    assert torch.allclose(g2, diag, rtol=1e-10, atol=1e-10)
    # ... and then the loss is exact score matching
    exact = exact_score_matching(score_from_log_prob(flow.log_prob), x)
    assert torch.allclose(kingma_score_matching(flow, x), exact, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("n_couplings", "hidden"), [(1, 5), (2, 1), (3, 5)])
def test_kingma_g2_differs_from_exact_diagonal_in_generic_case(n_couplings, hidden):
    # hidden > 1 (off-diagonal terms inside m) or >= 2 couplings (even/odd cross terms) break exactness
    flow, x = _flow(n_couplings=n_couplings, hidden=hidden), _x()
    score, diag = _exact_score_and_hessian_diag(flow, x)
    g1, g2 = kingma_backprop(flow, x)
    assert (g2 - diag).abs().max() > 1e-2
    # the first term is still exact SM's first term
    exact = exact_score_matching(score_from_log_prob(flow.log_prob), x)
    first = 0.5 * g1.pow(2).sum(1)
    assert torch.allclose(first, exact - diag.sum(1), rtol=1e-10, atol=1e-10)
    assert torch.allclose(kingma_score_matching(flow, x), first + g2.sum(1), rtol=1e-12, atol=1e-12)


def test_cp_is_unbiased_for_the_exact_hessian_diagonal_and_loss():
    flow, x = _flow(n_couplings=3), _x(b=3)
    _, diag = _exact_score_and_hessian_diag(flow, x)
    n = 20000
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _, s_r, s_i = curvature_propagation_backprop(flow, x.repeat(n, 1), generator=gen)
    est = (s_r.pow(2) - s_i.pow(2)).view(n, *x.shape)
    se = est.std(0) / n**0.5
    err = (est.mean(0) - diag).abs()
    assert (err < 5 * se + 1e-12).all(), (err / se).max()
    # the test has power: Kingma's biased diagonal on the same flow lies far outside the tolerance
    _, g2 = kingma_backprop(flow, x)
    assert ((g2 - diag).abs() > 5 * se).any()

    # the per-sample loss averages to exact score matching
    with torch.no_grad():
        loss = curvature_propagation_score_matching(flow, x.repeat(n, 1), generator=gen).view(n, -1)
    exact = exact_score_matching(score_from_log_prob(flow.log_prob), x, create_graph=False)
    se_loss = loss.std(0) / n**0.5
    assert ((loss.mean(0) - exact).abs() < 5 * se_loss).all()


def test_cp_n_samples_averages_draws():
    flow, x = _flow(), _x(b=2)
    gen = torch.Generator().manual_seed(5)
    many = curvature_propagation_score_matching(flow, x, n_samples=4, generator=gen)
    gen.manual_seed(5)
    single = curvature_propagation_score_matching(flow, x.repeat(4, 1), generator=gen).view(4, 2).mean(0)
    assert many.shape == (2,)
    assert torch.allclose(many, single)
    with pytest.raises(ValueError, match="n_samples"):
        curvature_propagation_score_matching(flow, x, n_samples=0)


@pytest.mark.parametrize("loss_fn", [kingma_score_matching, curvature_propagation_score_matching])
def test_gradients_reach_every_parameter(loss_fn):
    flow, x = _flow(), _x()
    loss_fn(flow, x).mean().backward()
    for name, p in flow.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_kingma_parameter_gradients_equal_exact_sm_in_exact_case():
    flow, x = _flow(n_couplings=1, hidden=1, n_layers=3), _x()
    params = list(flow.parameters())
    got = torch.autograd.grad(kingma_score_matching(flow, x).mean(), params)
    want = torch.autograd.grad(exact_score_matching(score_from_log_prob(flow.log_prob), x).mean(), params)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10)


def test_x_is_not_modified_or_differentiated():
    flow, x = _flow(), _x().requires_grad_(True)
    kingma_score_matching(flow, x).sum().backward()
    assert x.grad is None


def test_image_shaped_input_keeps_its_shape():
    flow, x = _flow(), _x()
    g1, g2 = kingma_backprop(flow, x.view(4, 2, 3))
    assert g1.shape == g2.shape == (4, 2, 3)
    assert torch.allclose(g1.reshape(4, D), kingma_backprop(flow, x)[0])


def test_deq_flow_raises():
    torch.manual_seed(0)
    flow = NICE(dim=D, n_couplings=2, m_net="deq", hidden=5).double()
    x = _x()
    for fn in (kingma_score_matching, curvature_propagation_score_matching):
        with pytest.raises(ValueError, match="explicit") as exc:
            fn(flow, x)
        assert "ssm" in str(exc.value)


def test_unsupported_layers_raise():
    flow = _flow()
    flow.m_nets[0][1] = torch.nn.Tanh()
    with pytest.raises(ValueError, match="Tanh"):
        kingma_score_matching(flow, _x())
    flow.m_nets[0][1] = torch.nn.Softplus(beta=2.0)
    with pytest.raises(ValueError, match="beta"):
        curvature_propagation_score_matching(flow, _x())


def test_bad_input_raises():
    flow = _flow()
    x = _x()
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        kingma_score_matching(flow, x)
    with pytest.raises(ValueError, match="shape"):
        kingma_score_matching(flow, torch.randn(3, 4, dtype=torch.float64))
