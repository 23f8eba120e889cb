"""The one activation-memory meter: what backward saves counts (under create_graph), a plain backward adds
nothing, parameters never count, a measured step leaves the module as it was, and on every family's phantom step
it counts what saved-tensor hooks count (its former way)."""

import functools

import pytest
import torch
from torch import nn

from deqscore.deq import DEQ
from deqscore.metrics import SavedTensorMeter, step_activation_bytes
from tests.deq.test_family_phantom import FAMILIES as PROBES


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


def _saved_tensor_hook_bytes(step, exclude) -> tuple[int, int]:
    """An independent count for the comparison below: the distinct storages that saved-tensor hooks see (the
    meter's former way, which torch.func refuses to run under), parameters excluded, every saved tensor pinned;
    in all, and without the 0-d tensors of a storage of their own (which the meter leaves out)."""
    excluded = {(p.untyped_storage().data_ptr(), p.device) for p in exclude}
    seen, pinned = {}, []

    def pack(t):
        pinned.append(t)
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in excluded:
            nbytes = t.untyped_storage().nbytes()
            seen[key] = (nbytes, seen.get(key, (0, False))[1] or t.dim() > 0 or nbytes > t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(n for n, _ in seen.values()), sum(n for n, counted in seen.values() if counted)


@pytest.mark.filterwarnings("ignore:Attribute .net. is an instance")
@pytest.mark.parametrize("torch_without_node_hooks", [False, True], ids=["node-creation hook", "torch before 2.14"])
@pytest.mark.parametrize("family", PROBES)
def test_the_meter_counts_what_saved_tensor_hooks_count_on_every_family_phantom_step(family, torch_without_node_hooks,
                                                                                    monkeypatch):
    """Through torch 2.14's node-creation hook, and through the saved-tensor hooks an older torch falls back on."""
    if torch_without_node_hooks:
        monkeypatch.delattr(torch.autograd.graph, "node_creation_hook", raising=False)
    torch.manual_seed(0)
    module, loss = PROBES[family](functools.partial(DEQ, backward="phantom", phantom_steps=2, tol=1e-10))
    params = [p for p in module.parameters() if p.requires_grad]

    def step():
        torch.manual_seed(3)
        torch.autograd.grad(loss().mean(), params, allow_unused=True)

    with SavedTensorMeter(exclude=params) as meter:
        step()
    everything, without_scalars = _saved_tensor_hook_bytes(step, params)
    assert meter.bytes == without_scalars > 0
    assert everything - meter.bytes < 1e-2 * everything  # a few 8-byte scalars
