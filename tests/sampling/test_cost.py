"""Sampling cost: network evaluations and DEQ solver iterations counted while an NCSN with a DEQ body samples."""

from functools import partial

import torch

from deqscore.deq import DEQ
from deqscore.models import NCSN
from deqscore.sampling import AnnealedLangevin
from deqscore.sampling.cost import counting_cost

SIGMAS = torch.tensor([1.0, 0.3, 0.1])


def _net(**deq_options) -> NCSN:
    torch.manual_seed(0)
    return NCSN(dim=64, channels=1, ngf=4, body="deq", deq=partial(DEQ, solver="picard", **deq_options)).eval()


def test_evaluations_are_levels_times_steps_plus_the_denoising_step_and_iterations_the_capped_solves():
    net = _net(max_iter=3, tol=1e-30, warn_on_nonconvergence=False)  # never converges: every solve is 3 iterations
    sampler = AnnealedLangevin(n_steps_each=2, step_lr=1e-3, final_denoise=True, progress=False)
    with counting_cost(net) as cost:
        sampler(net, (5, 64), SIGMAS, torch.Generator().manual_seed(0))
    assert (cost.evaluations, cost.solves, cost.iterations) == (3 * 2 + 1, 7, 21)
    assert cost.describe(batches=1) == ("7 network evaluations per sample; DEQ solver iterations 3.00 per "
                                        "evaluation, 21 per sample (warm start off)")


def test_the_line_says_whether_the_solves_started_warm():
    net = _net(max_iter=40, tol=1e-4, warm_start=True)
    sampler = AnnealedLangevin(n_steps_each=2, step_lr=1e-3, final_denoise=False, progress=False)
    with counting_cost(net) as cost:
        sampler(net, (3, 64), SIGMAS, torch.Generator().manual_seed(0))
        net.body.deq.warm_start = False
        sampler(net, (3, 64), SIGMAS, torch.Generator().manual_seed(0))
    assert (cost.solves, cost.warm_solves) == (12, 6)
    assert cost.describe(batches=2).endswith("(warm start on in 6 of 12 solves)")
    cost.warm_solves = cost.solves
    assert cost.describe(batches=2).endswith("(warm start on)")


def test_iterations_are_those_each_solve_recorded_and_hooks_are_removed():
    net = _net(max_iter=40, tol=1e-4)
    seen = []

    def score(x, sigma):  # an independent count: the layer's own statistics read after each evaluation
        out = net(x, sigma)
        seen.append(net.body.deq.stats.nstep)
        return out

    sampler = AnnealedLangevin(n_steps_each=3, step_lr=1e-3, final_denoise=False, progress=False)
    with counting_cost(net) as cost:
        sampler(score, (4, 64), SIGMAS, torch.Generator().manual_seed(0))
        sampler(score, (4, 64), SIGMAS, torch.Generator().manual_seed(1))
    assert cost.evaluations == len(seen) == 18 and cost.iterations == sum(seen) and len(set(seen)) > 1
    assert cost.describe(batches=2).startswith("9 network evaluations per sample")
    net(torch.rand(2, 64), torch.ones(2))
    assert cost.evaluations == 18  # outside the block nothing is counted
