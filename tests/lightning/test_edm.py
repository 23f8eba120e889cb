"""The EDM family: the Heun sampler's schedule and evaluation count, sampling deterministic for a seed, warm
starts of the DEQ body across Heun steps (the cost counted per sample), the DEQ body's activation memory against
the explicit U-Net's, and ``sample.py``'s report of the sampler's cost."""

import functools

import pytest
import torch

from deqscore.cli.sample import main as sample_main
from deqscore.cli.train import main as train_main
from deqscore.deq import DEQ
from deqscore.lightning.edm import EDMModule
from deqscore.metrics.memory import step_activation_bytes
from deqscore.models.edm import EDM
from deqscore.sampling.heun import EDMHeun

from .conftest import tiny_args

DEQ_OPTIONS = dict(solver="anderson", max_iter=30, tol=1e-3, stop_mode="rel", backward="ift", ift_tol=1e-4,
                   ift_max_iter=60)  # configs/edm/deq_mnist.yaml's


def test_the_heun_schedule_is_karras_rho_schedule_ending_at_zero():
    sampler = EDMHeun()
    sigmas = sampler.sigmas()
    assert len(sigmas) == 19 and sigmas[-1] == 0
    assert float(sigmas[0]) == pytest.approx(80.0) and float(sigmas[-2]) == pytest.approx(0.002)
    # by hand: the 10th level of 18 between 80 and 0.002 with rho = 7
    a, b = 80 ** (1 / 7), 0.002 ** (1 / 7)
    assert float(sigmas[9]) == pytest.approx((a + 9 / 17 * (b - a)) ** 7)
    assert (sigmas[1:] < sigmas[:-1]).all()


def test_heun_takes_35_evaluations_for_18_steps_and_a_seed_fixes_the_samples():
    calls = []

    def denoise(x, sigma):
        calls.append(float(sigma[0]))
        return 0.5 * x / (1 + sigma[:, None] ** 2)

    sampler = EDMHeun(num_steps=18)
    a = sampler(denoise, (8, 3), torch.Generator().manual_seed(5))
    assert len(calls) == 35 == sampler.evaluations
    # each step's first evaluation at its own level, the correction at the next one (none on the step to 0)
    levels = sampler.sigmas().tolist()
    assert calls == pytest.approx([lvl for i in range(18) for lvl in (levels[i], levels[i + 1])][:35])
    b = sampler(denoise, (8, 3), torch.Generator().manual_seed(5))
    c = sampler(denoise, (8, 3), torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("options", [{"num_steps": 0}, {"sigma_min": 1.0, "sigma_max": 0.5}, {"rho": -1.0}])
def test_bad_sampler_options_are_config_errors(options):
    from deqscore.errors import ConfigError

    with pytest.raises(ConfigError):
        EDMHeun(**options)


def _deq_module(ngf: int = 4, steps: int = 18) -> EDMModule:
    torch.manual_seed(0)
    net = EDM(dim=64, channels=1, ngf=ngf, body="deq", deq=functools.partial(DEQ, **DEQ_OPTIONS))
    return EDMModule(net, sampler=EDMHeun(num_steps=steps))


def test_deq_samples_are_deterministic_and_warm_starts_leave_them_within_the_solvers_tolerance():
    module = _deq_module()
    a = module.sample(6, torch.Generator().manual_seed(1))
    b = module.sample(6, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    cold = module.sample(6, torch.Generator().manual_seed(1), warm=False)
    assert a.shape == (6, 64) and a.min() >= 0 and a.max() <= 1
    # warm and cold solves end within the solver's relative tolerance of the same fixed points
    assert (a - cold).abs().max() < 0.05
    assert module.net.training  # sampling restores the mode and the layers' warm-start settings
    assert all(not d.warm_start and d.z_cache is None for d in module.deq_layers())


def test_sampling_cost_counts_evaluations_and_solver_iterations_cold_and_warm():
    module = _deq_module()
    cost = module.sampling_cost(n=4, seed=0)
    assert cost["evaluations_per_sample"] == 35
    for start in ("cold", "warm"):
        assert 1 <= cost[f"iterations_per_evaluation_{start}"] <= DEQ_OPTIONS["max_iter"]
        assert cost[f"iterations_per_sample_{start}"] == pytest.approx(35 * cost[f"iterations_per_evaluation_{start}"])
    # consecutive evaluations share a level and a nearby input: starting from the last fixed point saves solves
    assert cost["iterations_per_evaluation_warm"] < cost["iterations_per_evaluation_cold"]


def test_the_implicit_backward_gives_the_ift_gradient_of_the_first_order_loss():
    """Two independent backward solves of the same converged layer (IFT's adjoint fixed point, the implicit
    mode's own adjoint solve), both to 1e-11: the same parameter gradient of EDM's loss."""
    grads = {}
    for backward in ("ift", "implicit"):
        torch.manual_seed(0)
        deq = functools.partial(DEQ, solver="anderson", max_iter=200, tol=1e-11, stop_mode="rel", backward=backward,
                                ift_tol=1e-11, ift_max_iter=400)
        module = EDMModule(EDM(dim=16, channels=1, ngf=4, body="deq", deq=deq)).double()
        x = torch.rand(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        module.loss(module.net, 2 * x - 1, torch.Generator().manual_seed(2)).mean().backward()
        assert all(d.stats.converged for d in module.deq_layers())
        grads[backward] = torch.cat([p.grad.flatten() for p in module.net.parameters()])
    assert grads["ift"].abs().max() > 1e-3  # a gradient to compare, not zeros
    torch.testing.assert_close(grads["implicit"], grads["ift"], rtol=1e-6, atol=1e-9)


def test_the_deq_body_takes_at_most_the_explicit_unets_activation_memory():
    """At the MNIST configs' sizes (ngf 16), one training step on the same batch, saved tensors counted."""
    x = torch.rand(4, 784)
    sizes = {}
    for body, deq in (("unet", None), ("deq", functools.partial(DEQ, **DEQ_OPTIONS))):
        torch.manual_seed(0)
        module = EDMModule(EDM(dim=784, channels=1, ngf=16, body=body, deq=deq))
        sizes[body] = step_activation_bytes(lambda m=module: m.compute_loss(x).mean().backward(), module)
    assert sizes["deq"] <= sizes["unet"], sizes


def test_sample_py_prints_the_heun_samplers_evaluations_per_sample_and_the_solver_iterations(tmp_path, capsys):
    train_main(["fit", *tiny_args(tmp_path, "configs/edm/deq_mnist.yaml", "e"), "--trainer.max_steps", "1"])
    capsys.readouterr()
    ckpt = tmp_path / "e" / "checkpoints" / "last.ckpt"
    assert sample_main(["--checkpoint", str(ckpt), "--num-samples", "2", "--out", str(tmp_path / "s"),
                        "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    # the tiny overrides give the sampler 2 steps: 3 evaluations
    line = next(line for line in out.splitlines() if line.startswith("sampling cost: "))
    assert line.startswith("sampling cost: 3 network evaluations per sample; DEQ solver iterations "), line
    assert line.endswith("per sample (warm start on)"), line  # the sampler's default: each solve from the last
