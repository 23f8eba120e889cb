"""The one activation-memory meter: what backward saves counts (under create_graph), a plain backward adds
nothing, parameters never count, and a measured step leaves the module as it was."""

import torch
from torch import nn

from deqscore.metrics import SavedTensorMeter, step_activation_bytes


def _loss(lin: nn.Linear, x: torch.Tensor, create_graph: bool) -> torch.Tensor:
    y = torch.tanh(lin(x)).pow(2).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=create_graph)
    return g


def test_the_meter_counts_what_a_second_order_backward_saves():
    lin = nn.Linear(10, 10)
    x = torch.randn(4, 10, requires_grad=True)
    with SavedTensorMeter(exclude=lin.parameters()) as forward_only:
        torch.tanh(lin(x)).pow(2).sum()
    with SavedTensorMeter(exclude=lin.parameters()) as first_order:
        _loss(lin, x, create_graph=False)
    with SavedTensorMeter(exclude=lin.parameters()) as second_order:
        _loss(lin, x, create_graph=True)
    # forward: x, tanh's output and pow's input (the same storage): 2 x 160 bytes; a plain backward saves nothing
    assert forward_only.bytes == first_order.bytes == 320
    assert second_order.bytes > first_order.bytes  # the recorded backward keeps its own tensors


def test_a_measured_step_leaves_gradients_buffers_and_rng_untouched():
    net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(16, 5)
    net(x).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    stats = net[1].running_mean.clone()
    state = torch.random.get_rng_state()
    saved = step_activation_bytes(lambda: (net(torch.randn(16, 5)) ** 2).sum().backward(), net)
    assert saved > 0
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads, strict=True))
    assert torch.equal(net[1].running_mean, stats) and torch.equal(torch.random.get_rng_state(), state)
