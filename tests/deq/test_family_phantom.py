"""Every family's score network through its DEQ, under its own loss: with ``backward="phantom"`` the parameter
gradient of the loss equals that of the same loss with the DEQ replaced by the K damped steps written out by hand
from the frozen (detached) fixed point. Float64, tiny sizes; the losses differentiate twice through the layer
(score matching), so second derivatives of the phantom steps are compared too."""

import functools

import pytest
import torch
from torch import nn

from deqscore.deq import DEQ
from deqscore.lightning import DKEFModule, NCSNModule, NICEModule
from deqscore.models import DKEF, NCSN, NICE, ImplicitVAE

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


def _nice(deq):
    module = NICEModule(NICE(dim=4, n_couplings=2, m_net="deq", hidden=5, deq=deq), loss="ssm").double()
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return module, lambda: module.compute_loss(x)


def _dkef(deq):
    net = DKEF(dim=2, n_centres=4, hidden=4, feature_net="deq", deq=deq, bandwidth_init="fixed").double()
    x = torch.randn(12, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # centres away from the data: at a data point equal to a centre the kernel's clamped squared distance has a kink
    net.init_centres(torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    module = DKEFModule(net, loss="ssm_vr").train()  # training: alpha solved on one half, the loss on the other
    return module, lambda: module.compute_loss(x)


def _vae(deq):
    net = ImplicitVAE(dim=6, z_dim=2, eps_dim=2, hidden=5, score="deq", deq=deq).double()
    x = torch.bernoulli(torch.full((5, 6), 0.4, dtype=torch.float64), generator=torch.Generator().manual_seed(1))
    return net, lambda: net.score_loss(x).mean()  # SSM-VR of the score network s(x, .)


def _ncsn(deq):
    net = NCSN(dim=16, channels=1, ngf=4, body="deq", deq=deq)
    module = NCSNModule(net, loss="annealed_ssm_vr", sigma_max=1.0, sigma_min=0.1, n_levels=3).double()
    x = torch.rand(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return module, lambda: module.compute_loss(x)


FAMILIES = {"nice": _nice, "dkef": _dkef, "vae": _vae, "ncsn": _ncsn}


def _loss_gradients(build, deq, state=None):
    torch.manual_seed(0)
    module, loss = build(deq)
    if state is not None:
        module.load_state_dict(state)
    torch.manual_seed(3)  # the loss's own draws (projections, noise levels, encoder noise): the same for both
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(loss().mean(), list(params.values()), allow_unused=True)
    return module, dict(zip(params, grads, strict=True))


@pytest.mark.filterwarnings("ignore:Attribute .net. is an instance")
@pytest.mark.parametrize("family", FAMILIES)
def test_phantom_loss_gradient_equals_the_hand_written_steps(family):
    module, got = _loss_gradients(FAMILIES[family], PHANTOM)
    deqs = [m for m in module.modules() if isinstance(m, DEQ)]
    assert deqs and all(m.backward == "phantom" and m.stats.converged for m in deqs)
    _, want = _loss_gradients(FAMILIES[family], HandPhantom, module.state_dict())
    assert got.keys() == want.keys()
    inside = [n for n in got if ".func." in n]
    assert inside and any(got[n] is not None and got[n].abs().max() > 1e-6 for n in inside)
    for name in got:
        if want[name] is None:
            assert got[name] is None, name
            continue
        torch.testing.assert_close(got[name], want[name], rtol=1e-7, atol=1e-10, msg=name)
