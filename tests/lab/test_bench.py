"""The benchmark in quick mode: files, sections and the deterministic numbers (memory, gradient fidelity).

No timing is asserted: the machine may be shared.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from deqlab import main, run
from deqlab.configs import build, model_config
from deqlab.families import dkef as bench_dkef
from deqlab.families.ncsn import BODIES, LOSSES, build_ncsn
from deqlab.families.ncsn import options as ncsn_options
from deqlab.families.vae import ARCHS, build_vae
from deqlab.measure import MIB, loss_step_bytes, make_inputs
from deqlab.sections import section_funcs
from deqlab.settings import FORCED_TOL, QUICK
from deqscore.cli.train import DeqscoreCLI
from deqscore.cli.train import main as train
from deqscore.deq import DEQ, get_solver
from deqscore.lightning import NCSNModule, build_module, load_module
from deqscore.metrics import SavedTensorMeter, parameter_count
from tests.lightning.conftest import tiny_args

pytestmark = pytest.mark.xdist_group("bench")  # one worker runs the module, so its module fixture is built once

DKEF_RUN = bench_dkef.RUNS["quick"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    doc = run(quick=True, device="cpu", out_dir=out, threads=1)
    return out, doc


def _rows(doc: dict, section: str) -> list[dict]:
    return doc["sections"][section]["rows"]


def _memory(doc: dict, model: str) -> dict[int, float]:
    return {r["n"]: r["act_mib"] for r in _rows(doc, "memory_vs_iterations") if r["model"] == model}


def test_files_and_sections(result):
    out, doc = result
    md = (out / "bench.md").read_text()
    assert json.loads((out / "bench.json").read_text())["sections"].keys() == doc["sections"].keys()
    for name in (*section_funcs(), "targets"):
        assert f"## {doc['sections'][name]['title']}" in md
    for key in ("device", "torch", "threads", "date"):
        assert f"**{key}**" in md
    assert doc["settings"]["mode"] == "quick"


def test_deq_rows_run_exactly_the_requested_iterations(result):
    for row in _rows(result[1], "memory_vs_iterations"):
        if row["model"] in ("phantom", "unroll", "implicit"):
            assert row["solver_iters"] == row["n"]


@pytest.mark.parametrize("model", ["phantom", "implicit"])
def test_phantom_and_implicit_memory_are_flat_in_iterations(result, model):
    mem = _memory(result[1], model)
    assert sorted(mem) == sorted(QUICK.mem_iterations)
    assert max(mem.values()) <= 1.05 * min(mem.values())


def test_unroll_memory_grows_linearly(result):
    mem = _memory(result[1], "unroll")
    assert mem[128] >= 8 * mem[8]
    assert mem[32] > mem[8]


def test_explicit_memory_grows_with_depth(result):
    mem = _memory(result[1], "explicit MLP")
    depths = sorted(mem)
    assert all(mem[a] < mem[b] for a, b in zip(depths, depths[1:], strict=False))


def test_phantom_fidelity_improves_with_k(result):
    rows = [r for r in _rows(result[1], "phantom_fidelity") if r["variant"] == "phantom"]
    errors = [r["rel_error"] for r in sorted(rows, key=lambda r: r["K"])]
    floor = 1e-14  # float64 rounding
    assert all(b < a or b < floor for a, b in zip(errors, errors[1:], strict=False)), errors
    assert next(r for r in rows if r["K"] == 8)["cosine"] > 0.99


def test_targets_computed_from_measurements(result):
    targets = _rows(result[1], "targets")
    assert {t["pass"] for t in targets} <= {"PASS", "FAIL"}
    flat, ratio = targets[0], targets[1]
    assert flat["pass"] == "PASS" and flat["value"] <= 0.05
    phantom, unroll = _memory(result[1], "phantom"), _memory(result[1], "unroll")
    assert ratio["value"] == pytest.approx(phantom[32] / unroll[32])
    assert ratio["pass"] == ("PASS" if ratio["value"] <= 0.1 else "FAIL")


def test_implicit_section_has_every_family_s_rows_and_ratios(result):
    rows = _rows(result[1], "implicit")
    families = {r["family"] for r in rows}
    assert len(families) >= 4
    for family in families:
        variants = [r["variant"] for r in rows if r["family"] == family]
        assert variants[0] == "explicit shallow" and "DEQ, implicit" in variants
        assert all(r["act_mib"] > 0 for r in rows if r["family"] == family)
    shallow = next(r for r in rows if r["variant"] == "explicit shallow")
    assert shallow["act_ratio"] == "1.000x"


def test_solver_rows_report_convergence(result):
    rows = _rows(result[1], "solvers")
    assert {r["solver"] for r in rows} == {"picard", "anderson", "broyden"}
    assert all(r["converged"] or r["fevals"] == QUICK.sol_max_iter for r in rows)
    assert all(1 <= r["fevals"] <= QUICK.sol_max_iter for r in rows)
    assert all(r["vs_picard"] == 1.0 for r in rows if r["solver"] == "picard")


def test_nice_section_reports_ratios_and_solver_iterations(result):
    rows = _rows(result[1], "nice")
    deq = [r for r in rows if r["model"].startswith("DEQ")]
    assert [r["solver_iters"].count(",") + 1 for r in deq] == [4, 2]  # one count per coupling
    assert sum(r["model"].startswith("ratio") for r in rows) == 2


def test_cli_runs_a_subset(tmp_path):
    main(["--quick", "--device", "cpu", "--threads", "1", "--sections", "solvers", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert list(doc["sections"]) == ["solvers", "targets"]
    assert doc["sections"]["targets"]["rows"][0]["pass"] == "not run"


def test_unknown_section_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown sections"):
        run(quick=True, device="cpu", out_dir=tmp_path, sections=["nope"])


def test_solvers_on_a_trained_checkpoint(tmp_path):
    for config, name in (("configs/nice/deq.yaml", "deq"), ("configs/nice/explicit.yaml", "explicit")):
        train(["fit", *tiny_args(tmp_path, config, name), "--trainer.max_epochs", "1"])
    ckpt = tmp_path / "deq" / "checkpoints" / "last.ckpt"
    doc = run(quick=True, device="cpu", out_dir=tmp_path / "out", sections=["solvers"], trained_checkpoint=ckpt)
    rows = [r for r in _rows(doc, "solvers") if r["block"].startswith("trained")]
    assert {r["block"] for r in rows} == {"trained, coupling 0, float32", "trained, coupling 1, float32"}
    # the first coupling sees the raw batch: its Picard count is that of a direct solve
    flow = load_module(ckpt).net
    x, _ = make_inputs(QUICK.sol_batch, flow.dim, QUICK, torch.device("cpu"), torch.float32)
    m_net = flow.m_nets[0]
    with torch.no_grad():
        u = torch.nn.functional.softplus(m_net.inject(flow.split_halves(x)[0]))
        stop, tol = QUICK.sol_tolerances[0]
        _, stats = get_solver("picard")(lambda z: m_net.deq.func(z, u), torch.zeros_like(u), tol=tol,
                                        max_iter=QUICK.sol_max_iter, stop_mode=stop)
    picard = [r for r in rows if r["block"].endswith("0, float32") and r["solver"] == "picard"]
    assert picard[0]["fevals"] == stats.nstep
    with pytest.raises(ValueError, match="not a DEQ-NICE checkpoint"):
        run(quick=True, device="cpu", out_dir=tmp_path / "out2", sections=["solvers"],
            trained_checkpoint=tmp_path / "explicit" / "checkpoints" / "last.ckpt")


# ---------------------------------------------------------------- the meter


class _SquareSavingInBackward(torch.autograd.Function):
    """``x^2``, whose backward records a graph of its own (as a backward under create_graph does): tanh saves
    its output, a tensor of x's shape, while the backward runs."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            y = x.detach().requires_grad_(True)
            torch.tanh(y * 3).sum()  # recorded: tanh saves its output (the product is of a leaf and a number)
        return 2 * x * grad


def test_meter_counts_the_backward_too():
    w = nn.Parameter(torch.ones(8, 16))
    module = nn.Module()
    module.w = w
    x = torch.randn(8, 16)

    def loss() -> torch.Tensor:
        return _SquareSavingInBackward.apply(w * x).sum()  # the product saves x (w is a parameter)

    with SavedTensorMeter(exclude=[w]) as forward_only:
        loss()
    # forward: x (saved by the product) and w * x (saved by the function): 2 x 8 x 16 float32
    assert forward_only.bytes == 2 * 8 * 16 * 4
    # forward and backward: also the output of the tanh recorded inside the backward
    assert loss_step_bytes(module, loss) == 3 * 8 * 16 * 4
    assert w.grad is None


def test_meter_leaves_gradients_buffers_and_rng_as_they_were():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 1)).train()
    x = torch.randn(16, 4)
    for p in module.parameters():
        p.grad = torch.full_like(p, 7.0)
    stats = [b.clone() for b in module.buffers()]
    state = torch.get_rng_state()
    assert loss_step_bytes(module, lambda: module(x).pow(2).sum()) > 0
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(module.buffers(), stats, strict=True))
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- dkef


def _dkef_rows(doc: dict) -> list[dict]:
    return [r for r in _rows(doc, "dkef") if not r["model"].startswith("ratio")]


def _cli_options(options: dict[str, object]) -> list[str]:
    """Dotted model options as the training command line's arguments."""
    return [f"--model.init_args.{'.init_args.'.join(k.split('.'))}={v}" for k, v in options.items()]


def _trained_module(variant, dim: int, tmp_path) -> DeqscoreCLI:
    """The module of ``variant`` as ``train.py`` builds it, with the benchmark's quick options on the command line."""
    dm = bench_dkef.datamodule(variant, DKEF_RUN, "highdim", dim)
    options = {k: v for k, v in bench_dkef.options(DKEF_RUN, dm).items() if k != "net.dim"}  # dim: from the data
    data = ["--data.init_args.dataset=highdim", f"--data.init_args.dim={dim}",
            f"--data.init_args.batch_size={DKEF_RUN.batch}"]
    cli = DeqscoreCLI(args=["--config", variant.config, "--runs_root", str(tmp_path), *data, *_cli_options(options)],
                      run=False)
    cli.model.net.init_centres(dm.train_data, torch.Generator().manual_seed(0))  # as DKEFModule.setup does
    return cli


def test_dkef_rows_cover_every_data_set_and_net(result):
    rows = _dkef_rows(result[1])
    expected = {("highdim", d) for d in DKEF_RUN.dims}
    if bench_dkef.data_root().joinpath("winequality-red.csv").is_file():
        expected.add(("RedWine", 11))
    assert {(r["data"], r["dim"]) for r in rows} == expected
    for key in expected:
        nets = [r["model"] for r in rows if (r["data"], r["dim"]) == key]
        assert nets == ["explicit shallow", "explicit deep", "DEQ"]
    assert all(r["steps"] == DKEF_RUN.steps and r["repeats"] == DKEF_RUN.steps - 1 for r in rows)


def test_dkef_rows_are_those_of_the_modules_training_builds(result, tmp_path):
    """Parameters and activation memory of each row are those of the module train.py builds from the same config
    (measured directly by the meter, on the same batch and draws)."""
    for row in (r for r in _dkef_rows(result[1]) if r["data"] == "highdim"):
        variant = next(v for v in bench_dkef.VARIANTS if v.label == row["model"])
        cli = _trained_module(variant, row["dim"], tmp_path)
        module, dm = cli.model.train(), cli.datamodule
        dm.setup("fit")
        assert row["params"] == parameter_count(module)
        x = dm.train_data[: DKEF_RUN.batch].clone()  # a batch of its own, as the data loader gives
        torch.manual_seed(bench_dkef.MEMORY_SEED)
        assert row["act_mib"] * MIB == loss_step_bytes(module, lambda m=module, x=x: m.loss_terms(x)["loss"])


def test_dkef_log_likelihood_is_the_modules_test_metric_of_the_trained_weights():
    variant = bench_dkef.VARIANTS[2]
    dm = bench_dkef.datamodule(variant, DKEF_RUN, "highdim", 8)
    row, module = bench_dkef.fit_and_test(variant, DKEF_RUN, dm, torch.device("cpu"))
    net = module.net
    assert module.log_z_proposal == "mixture"  # the default: half the broad Gaussian, half at the training points
    log_z, stderr = net.log_partition(n_samples=module.final_log_z_samples, chunk=module.log_z_chunk,
                                      generator=torch.Generator().manual_seed(12345), proposal_points=dm.train_data)
    with torch.no_grad():
        ll = (net.log_density(dm.test_data) - log_z).mean().item()
    assert row["test_ll"] == pytest.approx(ll, rel=1e-5) and row["log_z_stderr"] == pytest.approx(float(stderr))
    assert row["true_ll"] == pytest.approx(dm.true_log_prob(dm.test_data).mean().item(), rel=1e-5)
    # trained: the weights differ from the config's initial ones
    fresh = bench_dkef.build_dkef(variant, DKEF_RUN, dm)
    assert not torch.equal(fresh.net.features[0].body.inject.weight, net.features[0].body.inject.weight)


def _dkef_step_memory(x: torch.Tensor, variant_index: int, **options) -> tuple[float, set[int]]:
    """Activation memory of one training step of a config-built DKEF and the iterations its solves ran."""
    dm = bench_dkef.datamodule(bench_dkef.VARIANTS[0], DKEF_RUN, "highdim", x.shape[1])
    module = bench_dkef.build_dkef(bench_dkef.VARIANTS[variant_index], DKEF_RUN, dm, **options)
    nbytes = bench_dkef.step_memory(module.train(), x)
    return nbytes, {layer.stats.nstep for layer in module.modules() if isinstance(layer, DEQ)}


def test_dkef_deq_memory_is_independent_of_solver_iterations():
    x = torch.randn(DKEF_RUN.batch, 6, generator=torch.Generator().manual_seed(0))
    # a tolerance no solve meets (FORCED_TOL): exactly max_iter iterations per solve, from zeros every time
    forced = {"net.deq.tol": FORCED_TOL, "net.deq.warm_start": False, "net.deq.warn_on_nonconvergence": False}
    (few, it_few), (many, it_many) = (_dkef_step_memory(x, 2, **forced, **{"net.deq.max_iter": n}) for n in (4, 40))
    assert (it_few, it_many) == ({4}, {40})
    assert few == many  # the same storages whatever the iterations (pinned: no address reuse aliases two)
    # the same solves recorded for backward (unroll) grow with the iterations: the check above can fail
    unroll = {**forced, "net.deq.backward": "unroll"}
    unroll_few, unroll_many = (_dkef_step_memory(x, 2, **unroll, **{"net.deq.max_iter": n})[0] for n in (4, 40))
    assert unroll_many > 2 * unroll_few > 2 * few
    # ... while an explicit net's grows with its depth
    deep = [_dkef_step_memory(x, 1, **{"net.deep_layers": n})[0] for n in (4, 16)]
    assert deep[1] > 2 * deep[0]


# ---------------------------------------------------------------- ncsn, vae


def test_ncsn_rows_cover_every_body_and_loss_with_ratios_to_ncsnv2(result):
    rows = _rows(result[1], "ncsn")
    steps = [r for r in rows if r.get("loss") and not r["model"].startswith("ratio")]
    assert {(r["model"], r["loss"]) for r in steps} == {
        (b.label, loss) for b in BODIES for loss in LOSSES
    } - {("DEQ, IFT", "annealed_ssm_vr")}  # IFT would give wrong SSM-VR gradients: not measured
    for r in steps:
        body = next(b for b in BODIES if b.label == r["model"])
        module = build_module(model_config(body.config, ncsn_options(QUICK, body, r["loss"])))
        assert r["params"] == parameter_count(module)
        assert r["act_mib"] > 0 and (r["solver_iters"] is not None) == ("deq" in body.config)
    for r in (r for r in rows if r["model"].startswith("ratio")):
        body = next(s for s in steps if s["loss"] == r["loss"] and r["model"] == f"ratio {s['model']} / NCSNv2")
        ref = next(s for s in steps if s["loss"] == r["loss"] and s["model"] == "NCSNv2")
        assert r["act_mib"] == f"{body['act_mib'] / ref['act_mib']:.3f}x"
    # phantom and IFT save the same tensors in DSM (one re-attaching application each)
    dsm = {r["model"]: r for r in steps if r["loss"] == "annealed_dsm"}
    assert dsm["DEQ, IFT"]["act_mib"] == pytest.approx(dsm["DEQ, phantom"]["act_mib"], rel=0.05)
    sampling = [r for r in rows if "sample_s_per_image" in r]
    assert [r["model"] for r in sampling] == [b.label for b in BODIES if b.options.get("net.deq.backward") != "ift"]
    for r in sampling:
        assert r["sample_s_per_image"] == pytest.approx(r["eval_ms_per_image"] * r["evaluations"] / 1e3)


def test_ncsn_schedule_and_memory_come_from_the_config(result):
    rows = _rows(result[1], "ncsn")
    body = BODIES[0]
    module = build_ncsn(QUICK, body, "annealed_dsm").train()
    config = model_config(body.config)["init_args"]
    defaults = inspect.signature(NCSNModule).parameters  # what the config leaves to the code
    for key, index in (("sigma_max", 0), ("sigma_min", -1)):
        expected = config.get(key, defaults[key].default)
        assert module.sigmas[index].item() == pytest.approx(expected)
    # the row's memory is the meter's on the config's module, the step's draws seeded as the benchmark seeds them
    x = torch.rand(4, module.net.dim, generator=torch.Generator().manual_seed(QUICK.seed))

    def step() -> torch.Tensor:
        torch.manual_seed(QUICK.seed)
        return module.loss_terms(x)["loss"]

    row = next(r for r in rows if r["model"] == body.label and r["loss"] == "annealed_dsm")
    assert row["act_mib"] * MIB == loss_step_bytes(module, step)
    sampling = next(r for r in rows if r["model"] == body.label and "evaluations" in r)
    assert sampling["evaluations"] == len(module.sigmas) * module.sampler.n_steps_each + 1


def test_vae_rows_compare_explicit_and_deq_score_networks(result):
    rows = _rows(result[1], "vae")
    for arch, variants in ARCHS.items():
        measured = {v.label: next(r for r in rows if r["model"] == f"{arch}, {v.label}") for v in variants}
        for v in variants:
            r, module = measured[v.label], build_vae(QUICK, arch, v)
            assert r["config"] == v.config
            assert r["score_params"] == parameter_count(module.net.score)
            assert r["params"] == parameter_count(module)
            assert r["act_mib"] > 0 and r["iteration_ms"] > 0
            assert (r["solver_iters"] is not None) == ("deq" in v.label)
        explicit = measured["explicit"]
        for v in variants[1:]:
            ratio = next(r for r in rows if r["model"] == f"ratio {v.label} / explicit, {arch}")
            assert ratio["act_mib"] == f"{measured[v.label]['act_mib'] / explicit['act_mib']:.3f}x"


def test_nice_rows_are_the_configs_modules(result):
    from deqlab.families.nice import VARIANTS, options

    rows = {r["model"]: r for r in _rows(result[1], "nice")}
    for v in VARIANTS:
        assert rows[v.label]["params"] == parameter_count(build(v.config, options(QUICK, v)))


@pytest.mark.parametrize("program", ["study", "deq_vs_ffn", "kernels", "sync", "gpu"])
def test_one_parser_tree_runs_every_program_by_name(program, monkeypatch):
    """``python -m deqlab <program> ARGS``: ARGS parsed by that program's branch of the one tree, then its ``run``."""
    from deqlab import cli

    top, programs = cli.parser_tree()
    monkeypatch.setattr(cli.PROGRAMS[program], "run", lambda parser, args: (parser.prog, args.program, args.out))
    assert main([program, "--out", "x"]) == (f"python -m deqlab {program}", program, Path("x") if program == "sync"
                                             else "x")
    assert set(programs) == {"study", "deq_vs_ffn", "kernels", "sync", "gpu"}


def test_no_laboratory_module_has_a_command_line_of_its_own():
    lab = Path(__file__).resolve().parents[2] / "lab" / "deqlab"
    entry_points = sorted(str(p.relative_to(lab)) for p in lab.rglob("__main__.py"))
    own = [str(p.relative_to(lab)) for p in lab.rglob("*.py") if p.name != "__main__.py"
           and ('if __name__ == "__main__"' in p.read_text() or ".parse_args(" in p.read_text())]
    assert entry_points == ["__main__.py"] and own == []


@pytest.mark.parametrize("argv, words", [
    (["--no-such-option"], "python -m deqlab: error: unrecognized arguments: --no-such-option"),
    (["--sections", "solvers,bogus"], "python -m deqlab: error: --sections: unknown sections ['bogus']"),
    (["--repeats", "x"], "python -m deqlab: error: argument --repeats: invalid int value: 'x'"),
    *[([program, "--no-such-option"], f"python -m deqlab {program}: error: unrecognized arguments")
      for program in ("study", "deq_vs_ffn", "kernels", "sync", "gpu")],
])
def test_every_benchmark_programs_usage_error_is_one_line_naming_it(argv, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and err.startswith(words) and err.count("\n") == 1, err
    assert "usage:" not in err and "Traceback" not in err and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_asking_the_benchmark_for_cuda_without_one_is_a_usage_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["--device", "cuda", "--quick", "--out", str(tmp_path)])
    assert info.value.code == 2 and capsys.readouterr().err == (
        "python -m deqlab: error: --device cuda asked for, but CUDA is not available\n")
