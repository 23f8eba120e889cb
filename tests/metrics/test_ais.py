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
