import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from deqscore.deq import FrobeniusScale, frobenius_scale, spectral_normalize


def test_frobenius_scale_value_and_gradient_flag():
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    out = frobenius_scale(w, c=2.0, eps=0.0)
    assert torch.allclose(out, w / (2 * torch.linalg.matrix_norm(w)))
    assert torch.linalg.matrix_norm(out, ord=2) <= 0.5 + 1e-12  # spectral <= Frobenius
    # with gradient through the norm, scaling w does not change the output: the gradient along w is zero
    (g_with,) = torch.autograd.grad((frobenius_scale(w, eps=0.0) * w.detach()).sum(), w)
    assert abs(torch.dot(g_with.flatten(), w.detach().flatten())) < 1e-10
    (g_without,) = torch.autograd.grad((frobenius_scale(w, eps=0.0, grad_through_norm=False) * w.detach()).sum(), w)
    assert torch.allclose(g_without, w.detach() / torch.linalg.matrix_norm(w.detach()))


def test_frobenius_parametrisation_makes_linear_layer_contractive():
    lin = nn.Linear(10, 10, dtype=torch.float64)
    parametrize.register_parametrization(lin, "weight", FrobeniusScale(c=1.0))
    x, y = torch.randn(100, 10, dtype=torch.float64), torch.randn(100, 10, dtype=torch.float64)
    ratio = (torch.tanh(lin(x)) - torch.tanh(lin(y))).norm(dim=1) / (x - y).norm(dim=1)
    assert ratio.max() < 1.0


def test_spectral_normalize_linear_matches_svd():
    lin = nn.Linear(7, 5, dtype=torch.float64)
    spectral_normalize(lin, n_power_iterations=100)
    assert torch.linalg.matrix_norm(lin.weight, ord=2).item() == pytest.approx(1.0, abs=1e-6)


def test_spectral_normalize_conv_uses_operator_norm():
    conv = nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64)
    w_raw = conv.weight.detach().clone()
    shape = (2, 6, 6)
    spectral_normalize(conv, n_power_iterations=200, input_shape=shape)
    # the convolution's exact operator norm from its dense matrix
    dense = torch.autograd.functional.jacobian(
        lambda x: torch.nn.functional.conv2d(x.view(1, *shape), w_raw, padding=1).flatten(),
        torch.zeros(2 * 36, dtype=torch.float64),
    )
    sigma = torch.linalg.matrix_norm(dense, ord=2)
    assert torch.allclose(conv.weight, w_raw / sigma, rtol=1e-5)


def test_spectral_normalize_rejects_other_modules():
    with pytest.raises(TypeError, match="Linear and nn.Conv2d"):
        spectral_normalize(nn.LayerNorm(3))


def test_spectral_normalised_layer_trains_inside_a_deq():
    from deqscore.deq import DEQ
    from deqscore.losses import score_from_log_prob, sliced_score_matching

    class Map(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = spectral_normalize(nn.Linear(6, 6, dtype=torch.float64))

        def forward(self, z, u):
            return 0.5 * torch.tanh(self.lin(z)) + u

    fmap = Map()
    deq = DEQ(fmap, tol=1e-10, max_iter=100, phantom_steps=3)
    x = torch.randn(4, 6, dtype=torch.float64)
    # the weight is read by every solver iteration and every phantom step of one graph
    loss = sliced_score_matching(score_from_log_prob(lambda x: -0.5 * deq(x).pow(2).sum(1)), x).mean()
    loss.backward()
    assert torch.isfinite(fmap.lin.parametrizations.weight.original.grad).all()
    assert fmap.lin.parametrizations.weight[0].v.device == fmap.lin.parametrizations.weight.original.device


def test_spectral_normalize_conv_without_input_shape_normalises_the_reshaped_kernel():
    # without an input shape the kernel is read as a matrix [out, in*k*k]; its largest singular value becomes 1
    torch.manual_seed(0)
    conv = spectral_normalize(nn.Conv2d(4, 6, 3), n_power_iterations=50)
    conv(torch.randn(2, 4, 8, 8))  # a training-mode forward runs further power iterations
    sigma = torch.linalg.matrix_norm(conv.weight.detach().reshape(6, -1), ord=2)
    assert abs(sigma.item() - 1.0) < 1e-4
