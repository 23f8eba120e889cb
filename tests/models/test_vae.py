import math

import pytest
import torch
from torch import nn

from deqscore.deq import DEQ, deq_backward
from deqscore.errors import ConfigError
from deqscore.models import GaussianVAE, ImplicitVAE
from deqscore.models.vae import log_standard_normal


class GaussianEncoder(nn.Module):
    """``z = A h + b + exp(log_s) * eps``: an implicit-encoder interface around a Gaussian q(z | x)."""

    def __init__(self, dim: int, z_dim: int):
        super().__init__()
        self.dim = dim
        self.mean = nn.Linear(dim, z_dim)
        self.log_s = nn.Parameter(0.3 * torch.randn(z_dim))

    def forward(self, h_eps: torch.Tensor) -> torch.Tensor:
        h, eps = h_eps[:, : self.dim], h_eps[:, self.dim :]
        return self.mean(h) + self.log_s.exp() * eps


class KnownScore(nn.Module):
    """``grad_z log q(z | x) = -(z - mu(x)) / s^2`` of a :class:`GaussianEncoder` (whose parameters it does not
    register: they stay the encoder's)."""

    def __init__(self, encoder: GaussianEncoder):
        super().__init__()
        self._encoder = (encoder,)

    def forward(self, h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        (enc,) = self._encoder
        return -(z - enc.mean(h)) / enc.log_s.exp() ** 2


def _gaussian_encoder_vae(dim=6, z_dim=3):
    torch.manual_seed(0)
    vae = ImplicitVAE(dim=dim, z_dim=z_dim, eps_dim=z_dim, hidden=8, score="explicit")
    vae.encoder = GaussianEncoder(dim, z_dim)
    vae.score = KnownScore(vae.encoder)
    return vae


def _entropy_term_grads(vae, x, seed):
    """Gradient in the encoder's parameters of the surrogate minus that of ``-log p(x, z)`` at the same draws: the
    surrogate's entropy part ``s(x, z).z``."""
    enc = vae.encoder
    params = [enc.mean.weight, enc.mean.bias, enc.log_s]
    torch.manual_seed(seed)
    full = torch.autograd.grad(vae.surrogate(x).mean(), params)
    torch.manual_seed(seed)
    z = vae.encode(x)
    joint = torch.autograd.grad(-vae.log_joint(x, z).mean(), params)
    torch.manual_seed(seed)
    eps = torch.randn(len(x), vae.eps_dim)  # the draws encode() made
    return [f - j for f, j in zip(full, joint, strict=True)], eps


def test_surrogate_entropy_gradient_is_exact_per_draw():
    # s(x, z).z with s = -(z - mu)/s^2 = -eps/s detached: d/dlog s_i = -eps_i^2, d/db = -eps/s, d/dA = 0 exactly
    vae = _gaussian_encoder_vae()
    x = torch.rand(32, 6).bernoulli()
    (grad_a, grad_b, grad_log_s), eps = _entropy_term_grads(vae, x, seed=1)
    s = vae.encoder.log_s.detach().exp()
    torch.testing.assert_close(grad_log_s, -eps.pow(2).mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_b, (-eps / s).mean(0), rtol=1e-5, atol=1e-6)
    # dz/dA = h: the term's A-gradient is mean(-eps/s outer h), zero in expectation
    torch.testing.assert_close(grad_a, (-eps / s).T @ x / len(x), rtol=1e-5, atol=1e-6)


def test_surrogate_entropy_gradient_matches_the_analytic_entropy_gradient():
    # in expectation the entropy term's gradient is that of -H(q) = -sum log s - const: -1 per log s, 0 for A and b
    vae = _gaussian_encoder_vae()
    x = torch.rand(200_000, 6).bernoulli()
    (grad_a, grad_b, grad_log_s), _ = _entropy_term_grads(vae, x, seed=2)
    # standard errors: sqrt(2/N) = 0.003 for log s, about 1/(s sqrt N) < 0.005 for A and b
    torch.testing.assert_close(grad_log_s, -torch.ones(3), rtol=0, atol=0.015)
    torch.testing.assert_close(grad_b, torch.zeros(3), rtol=0, atol=0.03)
    torch.testing.assert_close(grad_a, torch.zeros(3, 6), rtol=0, atol=0.03)


ARCH_SCORES = [("mlp", "explicit"), ("mlp", "deq"), ("conv", "explicit"), ("conv", "deq"), ("conv", "deq_full")]


@pytest.mark.parametrize(("arch", "score"), ARCH_SCORES)
def test_losses_reach_only_their_own_networks(arch, score):
    torch.manual_seed(0)
    dim, channels = (784, 1) if arch == "mlp" else (3 * 32 * 32, 3)
    vae = ImplicitVAE(dim=dim, channels=channels, arch=arch, z_dim=3, eps_dim=3, hidden=16, nef=4, score=score)
    x = torch.rand(4, dim).bernoulli()
    ae = {id(p) for p in vae.ae_parameters()}
    score_params = {id(p) for p in vae.score.parameters()}
    assert ae.isdisjoint(score_params) and len(ae) + len(score_params) == len(list(vae.parameters()))
    vae.score_loss(x).mean().backward()
    assert all((p.grad is not None) == (id(p) in score_params) for p in vae.parameters())
    vae.zero_grad(set_to_none=True)
    vae.surrogate(x).mean().backward()
    assert all(p.grad is None for p in vae.score.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vae.encoder.parameters())
    assert all(p.grad is not None for p in vae.decoder.parameters())


@pytest.mark.parametrize("n_projections", [1, 4])
def test_score_loss_is_sliced_score_matching_of_the_score_network(n_projections):
    # SSM-VR with Gaussian projections v: E_v[v^T J v] + 0.5 |s|^2 = tr J + 0.5 |s|^2 at the encoder's z, J = ds/dz
    torch.manual_seed(0)
    vae = ImplicitVAE(dim=5, z_dim=2, eps_dim=2, hidden=8, score="explicit", n_projections=n_projections)
    x, z = torch.rand(3, 5).bernoulli(), torch.randn(3, 2)
    vae.encode = lambda x_, eps=None: z  # the encoder's samples, held fixed
    expected = []
    for h, zi in zip(x, z, strict=True):
        s = vae.score(h[None], zi[None])[0]
        jac = torch.autograd.functional.jacobian(lambda v, h=h: vae.score(h[None], v[None])[0], zi)
        expected.append(jac.trace() + 0.5 * s.pow(2).sum())
    torch.manual_seed(1)
    estimate = torch.stack([vae.score_loss(x).detach() for _ in range(4000)]).mean(0)
    torch.testing.assert_close(estimate, torch.stack(expected).detach(), rtol=0, atol=0.05)


def test_gaussian_vae_surrogate_is_the_negative_elbo_in_expectation():
    # -ELBO = E_q[-log p(x|z)] + KL(q || N(0, I)); the analytic KL part checked against a Monte Carlo estimate
    torch.manual_seed(0)
    vae = GaussianVAE(dim=6, z_dim=2, hidden=8)
    x = torch.rand(2, 6).bernoulli()
    mu, log_var = vae.posterior(x)
    n = 100_000
    xr = x.repeat(n, 1)
    z = mu.repeat(n, 1) + (0.5 * log_var).exp().repeat(n, 1) * torch.randn(2 * n, 2)
    log_q = -0.5 * ((z - mu.repeat(n, 1)).pow(2) / log_var.exp().repeat(n, 1) + log_var.repeat(n, 1)
                    + math.log(2 * math.pi)).sum(1)
    mc = (-vae.log_joint(xr, z) + log_q).view(n, 2).mean(0)
    torch.manual_seed(1)
    surrogate = torch.stack([vae.surrogate(x) for _ in range(2000)]).mean(0)
    torch.testing.assert_close(surrogate.detach(), mc.detach(), rtol=0, atol=0.15)


def test_log_likelihood_closed_forms():
    torch.manual_seed(0)
    mlp = GaussianVAE(dim=4, z_dim=2, hidden=8)
    x, z = torch.rand(3, 4).bernoulli(), torch.randn(3, 2)
    p = torch.sigmoid(mlp.decoder(z))
    torch.testing.assert_close(mlp.log_likelihood(x, z), (x * p.log() + (1 - x) * (1 - p).log()).sum(1))
    torch.testing.assert_close(log_standard_normal(z), torch.distributions.Normal(0, 1).log_prob(z).sum(1))
    conv = GaussianVAE(dim=3 * 32 * 32, channels=3, arch="conv", z_dim=2, nef=4)
    x = torch.rand(2, 3 * 32 * 32)
    mean = conv.decoder(z[:2])
    normal = torch.distributions.Normal(mean, math.exp(-0.602))
    torch.testing.assert_close(conv.log_likelihood(x, z[:2]),
                               normal.log_prob(2 * x.view(2, 3, 32, 32) - 1).flatten(1).sum(1))


def test_deq_score_network_is_its_fixed_point():
    torch.manual_seed(0)
    vae = ImplicitVAE(dim=5, z_dim=2, eps_dim=2, hidden=8, score="deq",
                      deq=lambda f: DEQ(f, max_iter=200, tol=1e-10, solver="anderson"))
    x, z = torch.rand(3, 5), torch.randn(3, 2)
    net = vae.score
    u = torch.nn.functional.softplus(net.inject(torch.cat([x, z], 1)))
    h = torch.zeros_like(u)
    for _ in range(500):  # plain iteration of the 1/C-contractive map
        h = net.deq.func(h, u)
    torch.testing.assert_close(net(x, z), net.head(h), rtol=1e-5, atol=1e-6)


def _conv_deq_vae(score: str, deq=None, side: int = 16) -> ImplicitVAE:
    torch.manual_seed(0)
    return ImplicitVAE(dim=3 * side * side, channels=3, arch="conv", z_dim=2, eps_dim=2, nef=2, score=score,
                       deq=deq).double()


@pytest.mark.parametrize("score", ["deq", "deq_full"])
def test_conv_deq_map_contracts_and_the_network_is_its_fixed_point(score):
    vae = _conv_deq_vae(score, deq=lambda f: DEQ(f, max_iter=200, tol=1e-12, solver="anderson"))
    net = vae.score
    x, z = torch.rand(2, 3 * 16 * 16, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    h = torch.cat([vae.net_input(x), net.z_map(z).view(-1, 1, 16, 16)], 1)
    u = net.inject(h) if score == "deq" else torch.nn.functional.softplus(net.inject(h))
    z_star = net.deq(u).detach()
    # the fixed point, found by plain iteration of the map from zero
    w = torch.zeros_like(u)
    for _ in range(200):
        w = net.deq.func(w, u)
    torch.testing.assert_close(z_star, w, rtol=1e-8, atol=1e-10)
    assert z_star.shape[-1] == (4 if score == "deq" else 16)  # 4x4 patches: side / 4
    # the map's Jacobian at the fixed point: spectral radius (power iteration) below the 1/2 of the default C
    v = torch.randn_like(z_star)
    for _ in range(50):
        v = torch.autograd.functional.jvp(lambda q: net.deq.func(q, u), z_star, v)[1]
        rate, v = v.norm(), v / v.norm()
    assert 0 < rate < 0.5


def test_conv_deq_phantom_gradient_of_the_score_loss_converges_to_the_unrolled_one():
    """SSM-VR is second order: phantom steps from the fixed point, not IFT; with many steps they give the unrolled
    gradient, with one a different (truncated) one."""
    vae = _conv_deq_vae("deq", deq=lambda f: DEQ(f, max_iter=300, tol=1e-13, solver="anderson"))
    x = torch.rand(2, 3 * 16 * 16, dtype=torch.float64)

    def grads(mode: str, steps: int = 1) -> torch.Tensor:
        vae.zero_grad()
        vae.score.deq.phantom_steps = steps
        torch.manual_seed(3)
        with deq_backward(vae, mode):
            vae.score_loss(x).mean().backward()
        return torch.cat([p.grad.flatten() for p in vae.score.parameters()])

    unroll = grads("unroll")
    torch.testing.assert_close(grads("phantom", 60), unroll, rtol=1e-6, atol=1e-9)
    assert not torch.allclose(grads("phantom", 1), unroll, rtol=1e-4, atol=1e-9)


def test_bad_options_are_config_errors():
    for arch, score, bound in (("mlp", "deq", "1"), ("conv", "deq", "3"), ("conv", "deq_full", "5")):
        dim, channels = (784, 1) if arch == "mlp" else (3 * 16 * 16, 3)
        with pytest.raises(ConfigError, match=f"norm_scale must exceed {bound}"):
            ImplicitVAE(dim=dim, channels=channels, arch=arch, score=score, norm_scale=float(bound))
    with pytest.raises(ConfigError, match="deq_full"):
        ImplicitVAE(dim=784, score="deq_full")
    with pytest.raises(ConfigError, match="at least 16"):
        ImplicitVAE(dim=3 * 8 * 8, channels=3, arch="conv", score="deq")
    with pytest.raises(ConfigError, match="VAE arch"):
        ImplicitVAE(dim=4, arch="resnet")
    with pytest.raises(ConfigError, match="VAE score"):
        ImplicitVAE(dim=4, score="flow")
    with pytest.raises(ConfigError, match="4 \\* 2\\^k"):
        ImplicitVAE(dim=3 * 24 * 24, channels=3, arch="conv")
    with pytest.raises(ConfigError, match="backward='ift'"):
        ImplicitVAE(dim=4, score="deq", deq=lambda f: DEQ(f, backward="ift"))
    with pytest.raises(ValueError, match="784 values each"):
        ImplicitVAE(dim=784, hidden=8).surrogate(torch.rand(2, 10))


@pytest.mark.parametrize(("side", "score", "convs", "top", "out_side"), [
    (64, "explicit", 4, 8, 4), (64, "deq", 2, 8, 4), (64, "deq_full", 3, 8, 8),
    (32, "explicit", 3, 4, 4), (32, "deq", 1, 4, 4), (32, "deq_full", 3, 8, 4),
])
def test_conv_score_networks_downsample_as_documented(side, score, convs, top, out_side):
    # explicit: stride-2 convolutions nef * (1, 2, 4, ...) to 4x4; deq: 4x4 patches to side / 4 with 2 nef channels,
    # the fixed point there, then the explicit net's remaining stride-2 convolutions; deq_full: full-resolution
    # fixed point, then three stride-2 convolutions 2nef, 4nef, 8nef (docs/method.md 4.3)
    nef = 4
    vae = ImplicitVAE(dim=3 * side * side, channels=3, arch="conv", z_dim=2, eps_dim=2, nef=nef, score=score)
    strided = [m for m in vae.score.convs if isinstance(m, nn.Conv2d)]
    assert len(strided) == convs and all(m.stride == (2, 2) for m in strided)
    assert strided[-1].out_channels == nef * top
    assert vae.score.head[1].in_features == strided[-1].out_channels * out_side**2
    if score == "deq":
        inject = vae.score.inject
        assert (inject.kernel_size, inject.stride, inject.out_channels) == ((4, 4), (4, 4), 2 * nef)
    x = torch.rand(2, 3 * side * side)
    assert vae.score(vae.net_input(x), torch.randn(2, 2)).shape == (2, 2)


def test_explicit_mlp_score_network_depth_is_an_option_of_that_network_only():
    deep = ImplicitVAE(dim=12, z_dim=2, eps_dim=2, hidden=8, score="explicit", score_layers=5)
    linears = [m for m in deep.score.net if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(14, 8)] + [(8, 8)] * 4 + [(8, 2)]
    default = ImplicitVAE(dim=12, z_dim=2, eps_dim=2, hidden=8, score="explicit")
    assert sum(isinstance(m, nn.Linear) for m in default.score.net) == 3  # the reference's two hidden layers
    with pytest.raises(ConfigError, match="score_layers"):
        ImplicitVAE(dim=12, z_dim=2, eps_dim=2, hidden=8, score="deq", score_layers=5)
