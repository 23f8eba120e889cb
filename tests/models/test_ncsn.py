"""NCSN networks: building blocks against direct formulas, the output's 1/sigma scaling, the DEQ body's fixed
point and pre-step variants, IFT against the unrolled gradient for a first-order loss, and option errors."""

from functools import partial

import pytest
import torch

from deqscore.deq import DEQ, deq_backward
from deqscore.errors import ConfigError
from deqscore.losses import annealed_dsm
from deqscore.metrics import SavedTensorMeter, parameter_count
from deqscore.models import NCSN, NCSN_BODIES
from deqscore.models.ncsn import ELU, ConvMeanPool, InstanceNorm2dPlus, max_pool5, mean_pool2

F64 = torch.float64


def _net(body: str, channels: int = 3, side: int = 8, ngf: int = 4, **kw) -> NCSN:
    torch.manual_seed(0)
    deq = kw.pop("deq", partial(DEQ, solver="anderson", tol=1e-10, max_iter=200, stop_mode="rel"))
    return NCSN(dim=channels * side * side, channels=channels, ngf=ngf, body=body, deq=deq, **kw).double()


@pytest.mark.parametrize("body", NCSN_BODIES)
@pytest.mark.parametrize(("channels", "side"), [(1, 8), (3, 8)])
def test_output_is_a_score_field_scaled_by_one_over_sigma(body, channels, side):
    net = _net(body, channels, side).eval()
    x = torch.rand(3, channels * side * side, dtype=F64)
    s1 = net(x, torch.full((3,), 0.5, dtype=F64))
    s2 = net(x, torch.full((3,), 0.25, dtype=F64))
    assert s1.shape == x.shape
    assert torch.allclose(s2, 2 * s1, atol=1e-8)  # unconditional body, output / sigma
    images = net(x.view(3, channels, side, side), torch.full((3,), 0.5, dtype=F64))
    assert images.shape == (3, channels, side, side) and torch.allclose(images.flatten(1), s1, atol=1e-8)


def test_samples_in_a_batch_are_independent():
    """Instance norms only: no statistic is shared across the batch, so one sample's output ignores the others."""
    net = _net("ncsnv2").eval()
    x, sigma = torch.rand(4, 192, dtype=F64), torch.full((4,), 0.3, dtype=F64)
    assert torch.allclose(net(x, sigma)[:1], net(x[:1], sigma[:1]), atol=1e-8)


def test_instance_norm_plus_matches_its_formula():
    torch.manual_seed(0)
    norm = InstanceNorm2dPlus(5).double()
    with torch.no_grad():
        norm.beta.normal_()
    x = torch.randn(2, 5, 4, 4, dtype=F64) * 3 + 1
    mu = x.mean((2, 3), keepdim=True)
    var = x.var((2, 3), unbiased=False, keepdim=True)
    means = x.mean((2, 3))
    means = (means - means.mean(1, keepdim=True)) / torch.sqrt(means.var(1, keepdim=True) + 1e-5)
    h = (x - mu) / torch.sqrt(var + 1e-5) + means[..., None, None] * norm.alpha[:, None, None]
    expected = norm.gamma[:, None, None] * h + norm.beta[:, None, None]
    assert torch.allclose(norm(x), expected, atol=1e-10)


def test_conv_mean_pool_averages_the_four_strided_grids():
    torch.manual_seed(0)
    pool = ConvMeanPool(2, 3).double()
    x = torch.randn(1, 2, 6, 6, dtype=F64)
    out = pool.conv(x)
    expected = (out[..., ::2, ::2] + out[..., 1::2, ::2] + out[..., ::2, 1::2] + out[..., 1::2, 1::2]) / 4
    assert torch.allclose(pool(x), expected, atol=1e-12)


@pytest.mark.parametrize("side", [6, 7])
def test_mean_pool_equals_avg_pool2d(side):
    x = torch.randn(2, 3, side, side + 1, dtype=F64)
    assert torch.allclose(mean_pool2(x), torch.nn.functional.avg_pool2d(x, 2), atol=1e-12)


def test_conv_mean_pool_saves_less_than_conv_then_avg_pool2d():
    # the pooled convolution output is not kept for backward: only the input of the convolution is
    torch.manual_seed(0)
    pool = ConvMeanPool(4, 4)
    x = torch.randn(2, 4, 16, 16, requires_grad=True)
    with SavedTensorMeter(exclude=pool.parameters()) as ours:
        out = pool(x)
    with SavedTensorMeter(exclude=pool.parameters()) as ref:
        expected = torch.nn.functional.avg_pool2d(pool.conv(x), 2)
    assert torch.allclose(out, expected, atol=1e-6)
    assert ours.bytes == x.numel() * x.element_size()
    assert ref.bytes == 2 * ours.bytes


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_elu_has_torch_elus_values_and_derivatives_of_the_first_and_second_order(dtype):
    x = torch.cat([torch.linspace(-30, 3, 1001, dtype=dtype), torch.tensor([0.0, -1e-8, 1e-8], dtype=dtype)])
    x.requires_grad_()
    with SavedTensorMeter() as saved_ours:
        ours = ELU()(x)
    with SavedTensorMeter() as saved_ref:
        ref = torch.nn.functional.elu(x)
    assert saved_ours.bytes == saved_ref.bytes == x.numel() * x.element_size()  # the input alone, as nn.ELU
    spacing = torch.finfo(dtype).eps  # exp(x) - 1 rounds at 1's spacing where expm1 does not
    assert torch.equal(ours[x > 0], ref[x > 0]) and torch.allclose(ours, ref, rtol=0, atol=spacing)
    g = torch.randn_like(x)
    (d_ours,) = torch.autograd.grad(ours, x, g, create_graph=True)
    (d_ref,) = torch.autograd.grad(ref, x, g, create_graph=True)
    assert torch.equal(d_ours, d_ref)
    assert torch.equal(*(torch.autograd.grad(d.square().sum(), x)[0] for d in (d_ours, d_ref)))
    # under torch.func (the exact DEQ backward takes its partials with it): the same vector-Jacobian product
    _, vjp_ours = torch.func.vjp(ELU(), x.detach())
    _, vjp_ref = torch.func.vjp(torch.nn.functional.elu, x.detach())
    assert torch.equal(vjp_ours(g)[0], vjp_ref(g)[0])


def test_max_pool5_has_max_pool2ds_values_and_gradient_from_any_layout():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 9, 11).transpose(-1, -2).requires_grad_()  # not contiguous
    ours, ref = max_pool5(x), torch.nn.functional.max_pool2d(x, 5, stride=1, padding=2)
    assert ours.is_contiguous() and torch.equal(ours, ref)  # a maximum selects a value: exact in either layout
    g = torch.randn_like(ref)
    # an input's gradient sums the output gradients of the (at most 25) windows whose maximum it is; the two layouts'
    # kernels may add them in another order, so they agree to that many roundings, not bit for bit
    tolerance = 25 * torch.finfo(g.dtype).eps * g.abs().max()
    assert torch.allclose(torch.autograd.grad(ours, x, g)[0], torch.autograd.grad(ref, x, g)[0], rtol=0,
                          atol=tolerance.item())


def test_ncsnv2_at_cifar10_size_has_the_published_parameter_count():
    # NCSNv2 (Song & Ermon 2020) reports 29.7M parameters for CIFAR-10 at ngf 128
    assert parameter_count(NCSN(dim=3 * 32 * 32, ngf=128, body="ncsnv2")) == pytest.approx(29.7e6, rel=2e-3)


DEQ_BODIES = ("deq", "deq_full")


def _injection(net: NCSN, u_side: torch.Tensor) -> torch.Tensor:
    """The DEQ's input for a begin_conv output ``u_side``: the down block's output (half resolution, 2 ngf) in the
    ``deq`` body, the begin_conv output itself in ``deq_full``."""
    return net.body.down(u_side) if net.body_kind == "deq" else u_side


@pytest.mark.parametrize("body", DEQ_BODIES)
def test_deq_body_output_is_the_fixed_point_and_double_prestep_is_not(body):
    deq = partial(DEQ, solver="anderson", tol=1e-11, max_iter=300, stop_mode="rel", injection_prestep=True,
                  phantom_steps=1)
    nets = {double: _net(body, deq=deq, double_prestep=double) for double in (False, True)}
    nets[True].load_state_dict(nets[False].state_dict())
    u = _injection(nets[False], torch.randn(2, 4, 8, 8, dtype=F64))
    layer = nets[False].body.deq
    z_single, z_double = (net.body.deq(u) for net in nets.values())
    residual = (layer.func(z_single, u) - z_single).norm() / z_single.norm()
    assert residual < 1e-8 and layer.stats.converged
    # the reference's pre-step re-attaches RB(RB(z*)) / w + u, which is not the fixed point
    assert (z_double - z_single).norm() / z_single.norm() > 1e3 * residual


def test_deq_body_holds_its_fixed_point_at_half_resolution_and_records_less():
    """The default body solves at side / 2 with 2 ngf channels, the reference body at full resolution with ngf;
    the default's training step records less than the reference's and than the shallow explicit body's."""
    nets = {body: _net(body, side=16, ngf=8).float() for body in ("deq", "deq_full", "shallow")}
    h = torch.randn(2, 8, 16, 16)
    assert nets["deq"].body.down(h).shape == (2, 16, 8, 8)
    x, sigmas, labels = torch.rand(4, 3 * 16 * 16), torch.tensor([1.0, 0.1]), torch.tensor([0, 1, 0, 1])
    saved = {}
    for body, net in nets.items():
        with SavedTensorMeter(exclude=net.parameters()) as meter:
            torch.manual_seed(0)
            annealed_dsm(net, x, sigmas, labels).mean().backward()
        saved[body] = meter.bytes
    assert saved["deq"] < 0.6 * saved["deq_full"] and saved["deq"] < 0.6 * saved["shallow"]


@pytest.mark.parametrize("body", DEQ_BODIES)
def test_deq_map_contracts_on_its_fixed_point(body):
    """Power iteration on the map's Jacobian at the fixed point: spectral radius below 1 at initialisation."""
    net = _net(body)
    u = _injection(net, torch.randn(1, 4, 8, 8, dtype=F64))
    z = net.body.deq(u).detach()
    v = torch.randn_like(z)
    for _ in range(50):
        v = torch.autograd.functional.jvp(lambda z_: net.body.deq.func(z_, u), z, v)[1]
        rate, v = v.norm(), v / v.norm()
    assert 0 < rate < 1


@pytest.mark.parametrize("body", DEQ_BODIES)
def test_ift_gives_the_unrolled_parameter_gradient_for_annealed_dsm(body):
    deq = partial(DEQ, solver="anderson", tol=1e-12, max_iter=400, stop_mode="rel", ift_tol=1e-12,
                  ift_max_iter=400, backward="ift")
    net = _net(body, deq=deq)
    x, sigmas = torch.rand(3, 192, dtype=F64), torch.tensor([1.0, 0.3, 0.1], dtype=F64)
    labels = torch.tensor([0, 1, 2])

    def grads(mode: str, steps: int | None = None) -> torch.Tensor:
        net.zero_grad()
        net.body.deq.phantom_steps = steps or 1
        torch.manual_seed(4)
        with deq_backward(net, mode):
            annealed_dsm(net, x, sigmas, labels).mean().backward()
        return torch.cat([p.grad.flatten() for p in net.parameters()])

    ift, unroll = grads("ift"), grads("unroll")
    assert torch.allclose(ift, unroll, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(grads("phantom"), unroll, rtol=1e-3)  # a truncated gradient differs: test can fail
    # enough phantom steps from the fixed point converge to the same gradient
    assert torch.allclose(grads("phantom", 200), unroll, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(("kw", "match"), [
    ({"body": "unet"}, "body"),
    ({"channels": 2}, "channels"),  # 192 values are not a square 2-channel image
    ({"ngf": 0}, "ngf"),
    ({"body": "shallow", "double_prestep": True}, "double_prestep"),
    ({"body": "deq", "double_prestep": True}, "injection_prestep"),
])
def test_bad_options_raise_config_error(kw, match):
    opts = {"dim": 192, "channels": 3, "ngf": 4} | kw
    with pytest.raises(ConfigError, match=match):
        NCSN(**opts)


@pytest.mark.parametrize("body", ["ncsnv2", "deq"])
def test_bodies_that_halve_the_resolution_need_an_even_side_and_inputs_their_size(body):
    with pytest.raises(ConfigError, match="even"):
        NCSN(dim=3 * 7 * 7, channels=3, ngf=4, body=body)
    with pytest.raises(ValueError, match=r"\[B, 192\]"):
        _net("shallow")(torch.rand(2, 100, dtype=F64), torch.ones(2, dtype=F64))


def test_input_is_mapped_to_minus_one_one_unless_centered():
    a, b = _net("shallow"), _net("shallow", centered=True)
    x, sigma = torch.rand(2, 192, dtype=F64), torch.ones(2, dtype=F64)
    assert torch.allclose(a(x, sigma), b(2 * x - 1, sigma), atol=1e-10)
    assert not torch.allclose(a(x, sigma), b(x, sigma), atol=1e-3)
