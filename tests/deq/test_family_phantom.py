"""Every family's score network through its DEQ, under its own loss (its fixtures' ``phantom_probe``,
``tests/families``): with ``backward="phantom"`` the parameter gradient of the loss equals that of the same loss
with the DEQ replaced by the K damped steps written out by hand from the frozen (detached) fixed point. Float64,
tiny sizes; the losses differentiate twice through the layer (score matching), so second derivatives of the
phantom steps are compared too."""

import functools

import pytest
import torch
from torch import nn

from deqscore.deq import DEQ
from tests.deq.helpers import loss_gradients
from tests.families import fixtures

K, LAM = 3, 0.6


class HandPhantom(nn.Module):
    """The phantom backward written out: Picard iteration to convergence without a graph, then K damped steps
    ``z <- lam * func(z, u) + (1 - lam) * z`` recorded by autograd. Same parameter names as :class:`DEQ`."""

    def __init__(self, func: nn.Module):
        super().__init__()
        self.func = func

    def forward(self, u, z0=None):
        with torch.no_grad():
            z = torch.zeros_like(u)
            for _ in range(5000):
                z_new = self.func(z, u)
                if (z_new - z).abs().max() < 1e-14:
                    break
                z = z_new
            else:
                raise AssertionError("the reference Picard iteration did not converge")
            z = z_new
        for _ in range(K):
            z = LAM * self.func(z, u) + (1 - LAM) * z
        return z


PHANTOM = functools.partial(DEQ, backward="phantom", phantom_steps=K, phantom_damping=LAM, solver="anderson",
                            tol=1e-13, max_iter=500, warn_on_nonconvergence=False)


#: family -> its phantom probe (tests/families/<name>.py), for every declared family that has one
FAMILIES = {name: file.phantom_probe for name, file in fixtures().items() if hasattr(file, "phantom_probe")}


@pytest.mark.filterwarnings("ignore:Attribute .net. is an instance")
@pytest.mark.parametrize("family", FAMILIES)
def test_phantom_loss_gradient_equals_the_hand_written_steps(family):
    module, got = loss_gradients(FAMILIES[family], PHANTOM)
    deqs = [m for m in module.modules() if isinstance(m, DEQ)]
    assert deqs and all(m.backward == "phantom" and m.stats.converged for m in deqs)
    _, want = loss_gradients(FAMILIES[family], HandPhantom, module.state_dict())
    assert got.keys() == want.keys()
    inside = [n for n in got if ".func." in n]
    assert inside and any(got[n] is not None and got[n].abs().max() > 1e-6 for n in inside)
    for name in got:
        if want[name] is None:
            assert got[name] is None, name
            continue
        torch.testing.assert_close(got[name], want[name], rtol=1e-7, atol=1e-10, msg=name)
