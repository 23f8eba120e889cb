import math

import pytest
import torch

from deqscore.metrics.ais import ais_log_likelihood, sigmoid_schedule
from deqscore.models import GaussianVAE


def test_sigmoid_schedule_runs_from_zero_to_one_increasing():
    betas = sigmoid_schedule(100)
    assert betas[0] == 0 and betas[-1] == 1 and len(betas) == 101
    steps = betas.diff()
    assert (steps > 0).all() and steps[0] < steps[50] and steps[-1] < steps[50]  # dense at both ends


def test_ais_matches_the_linear_gaussian_closed_form():
    # p(z) = N(0, I_3), p(x | z) = N(W z + c, sigma^2 I_5): p(x) = N(c, W W^T + sigma^2 I)
    torch.manual_seed(0)
    w, c, sigma = 0.7 * torch.randn(5, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64), 1.0
    marginal = torch.distributions.MultivariateNormal(c, w @ w.T + sigma**2 * torch.eye(5, dtype=torch.float64))
    x = marginal.sample((4,))

    def log_lik(x_, z):
        return torch.distributions.Normal(z @ w.T + c, sigma).log_prob(x_).sum(1)

    est = ais_log_likelihood(log_lik, x, z_dim=3, n_steps=500, n_chains=64, leapfrog=10, step_size=0.05,
                             generator=torch.Generator().manual_seed(1), progress=False)
    truth = marginal.log_prob(x)
    assert est.dtype == torch.float64 and est.shape == (4,)
    # here the chains' log weights spread by about 0.25 (while importance sampling from the prior spreads by 5):
    # the estimate's standard error is about 0.03
    torch.testing.assert_close(est, truth, rtol=0, atol=0.1)
    # one chain's log weight is a lower bound in expectation (Jensen), far below with a 2-step schedule
    one_chain = ais_log_likelihood(log_lik, x.repeat(500, 1), z_dim=3, n_steps=2, n_chains=1, step_size=0.05,
                                   generator=torch.Generator().manual_seed(1), progress=False)
    assert (one_chain.view(500, 4).mean(0) < truth - 0.5).all()


def test_ais_on_a_bernoulli_decoder_matches_quadrature():
    # the VAE's own likelihood (784 Bernoulli pixels) with a 1-d latent: log p(x) = log int N(z) p(x|z) dz on a grid
    torch.manual_seed(0)
    vae = GaussianVAE(dim=784, z_dim=1, hidden=16).double()
    with torch.no_grad():
        x = torch.bernoulli(vae.decode_mean(torch.randn(2, 1, dtype=torch.float64)))
        grid = torch.linspace(-8, 8, 16001, dtype=torch.float64)[:, None]
        log_joint = torch.stack([vae.log_joint(xi.expand(len(grid), -1), grid) for xi in x])
        truth = torch.logsumexp(log_joint, 1) + math.log(grid[1, 0] - grid[0, 0])
    est = ais_log_likelihood(vae.log_likelihood, x, z_dim=1, n_steps=300, n_chains=16, step_size=0.05,
                             generator=torch.Generator().manual_seed(2), progress=False)
    torch.testing.assert_close(est, truth, rtol=0, atol=0.1)


@pytest.mark.parametrize(("key", "value"), [("n_steps", 0), ("n_chains", -1), ("leapfrog", 0), ("step_size", 0.0)])
def test_bad_ais_options_raise(key, value):
    with pytest.raises(ValueError, match=f"AIS {key}"):
        ais_log_likelihood(lambda x, z: z.sum(1), torch.zeros(1, 2), z_dim=1, progress=False, **{key: value})


def reference_ais(log_lik, x, z_dim, n_steps, n_chains, leapfrog, step_size, generator):
    """AIS written out the direct way: every log target and gradient evaluated afresh (one likelihood pass for the
    weight and one for the move's start in every step, beside the leapfrog steps'), with the same random stream."""
    from deqscore.metrics.ais import TARGET_ACCEPTANCE, sigmoid_schedule

    def target(z, beta):
        with torch.enable_grad():
            z = z.detach().requires_grad_(True)
            value = -0.5 * z.pow(2).sum(1) + beta * log_lik(xr, z)
            (grad,) = torch.autograd.grad(value.sum(), z)
        return value.detach(), grad

    b = x.shape[0]
    xr = x.repeat_interleave(n_chains, 0)
    z = torch.randn(b * n_chains, z_dim, generator=generator, dtype=x.dtype)
    step = torch.full((b * n_chains,), step_size, dtype=x.dtype)
    betas = sigmoid_schedule(n_steps).tolist()
    log_w = torch.zeros(b * n_chains, dtype=torch.float64)
    for t in range(1, n_steps + 1):
        log_w += (betas[t] - betas[t - 1]) * log_lik(xr, z).double()
        eps = step[:, None]
        p0 = torch.randn(z.shape, generator=generator, dtype=z.dtype)
        value0, grad = target(z, betas[t])
        z_new, p = z, p0 + 0.5 * eps * grad
        for i in range(leapfrog):
            z_new = z_new + eps * p
            value, grad = target(z_new, betas[t])
            p = p + (eps if i < leapfrog - 1 else 0.5 * eps) * grad
        log_accept = (value - 0.5 * p.pow(2).sum(1)) - (value0 - 0.5 * p0.pow(2).sum(1))
        u = torch.rand(log_accept.shape, generator=generator, dtype=z.dtype)
        accept = torch.isfinite(log_accept) & (u.log() < log_accept)
        z = torch.where(accept[:, None], z_new, z)
        rate = accept.to(step.dtype).view(b, n_chains).mean(1).repeat_interleave(n_chains)
        step = step * torch.exp(0.02 * (rate - TARGET_ACCEPTANCE))
    return torch.logsumexp(log_w.view(b, n_chains), 1) - math.log(n_chains)


def test_ais_reuses_each_likelihood_pass_and_gives_the_direct_estimate():
    """The estimator evaluates the likelihood only in leapfrog steps (the weight and the move's start reuse the
    previous move's end): the same estimate as the direct way, to float64 rounding, on a non-Gaussian decoder."""
    torch.manual_seed(0)
    weight = torch.randn(3, 5, dtype=torch.float64)

    def log_lik(x, z):  # a Bernoulli decoder of a tanh layer
        return -torch.nn.functional.binary_cross_entropy_with_logits(torch.tanh(z @ weight) * 3, x,
                                                                     reduction="none").sum(1)

    x = torch.bernoulli(torch.full((4, 5), 0.3, dtype=torch.float64), generator=torch.Generator().manual_seed(1))
    options = dict(z_dim=3, n_steps=40, n_chains=6, leapfrog=4, step_size=0.1)
    fast = ais_log_likelihood(log_lik, x, generator=torch.Generator().manual_seed(2), progress=False, **options)
    direct = reference_ais(log_lik, x, generator=torch.Generator().manual_seed(2), **options)
    assert torch.allclose(fast, direct, rtol=0, atol=1e-9), (fast - direct).abs().max()
