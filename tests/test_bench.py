"""The benchmark in quick mode: files, sections and the deterministic numbers (memory, gradient fidelity).

No timing is asserted: the machine may be shared.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from deqscore.bench import main, run
from deqscore.bench.dkef import build_dkef, data_root, make_module, step_activation_mib
from deqscore.bench.measure import make_inputs
from deqscore.bench.ncsn import build_ncsn
from deqscore.bench.settings import FORCED_TOL, QUICK, SECTIONS
from deqscore.bench.vae import build_vae
from deqscore.cli.train import main as train
from deqscore.data import UCIDataModule
from deqscore.deq import DEQ, get_solver
from deqscore.lightning import load_module
from deqscore.models import DKEF
from tests.lightning.conftest import tiny_args


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
    for name in (*SECTIONS, "targets"):
        assert f"## {doc['sections'][name]['title']}" in md
    for key in ("device", "torch", "threads", "date"):
        assert f"**{key}**" in md
    assert doc["settings"]["mode"] == "quick"


def test_deq_rows_run_exactly_the_requested_iterations(result):
    for row in _rows(result[1], "memory_vs_iterations"):
        if row["model"] in ("phantom", "unroll"):
            assert row["solver_iters"] == row["n"]


def test_phantom_memory_is_flat_in_iterations(result):
    mem = _memory(result[1], "phantom")
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


def test_solver_rows_report_convergence(result):
    rows = _rows(result[1], "solvers")
    assert {r["solver"] for r in rows} == {"picard", "anderson", "broyden"}
    assert all(r["converged"] or r["fevals"] == QUICK.sol_max_iter for r in rows)
    assert all(1 <= r["fevals"] <= QUICK.sol_max_iter for r in rows)
    assert all(r["vs_picard"] == 1.0 for r in rows if r["solver"] == "picard")


def test_nice_section_reports_ratios_and_solver_iterations(result):
    rows = _rows(result[1], "nice")
    deq = [r for r in rows if r["model"].startswith("deq")]
    assert len(deq) == len(QUICK.nice_couplings)
    assert all(r["solver_iters"] for r in deq)
    assert sum(r["model"].startswith("ratio") for r in rows) == len(QUICK.nice_couplings)


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


# ---------------------------------------------------------------- dkef


def _dkef_rows(doc: dict) -> list[dict]:
    return [r for r in _rows(doc, "dkef") if not r["model"].startswith("ratio")]


def test_dkef_rows_cover_every_data_set_and_net(result):
    rows = _dkef_rows(result[1])
    expected = {("highdim", d) for d in QUICK.dkef_dims}
    if data_root(QUICK).joinpath("winequality-red.csv").is_file():
        expected.add(("RedWine", 11))
    assert {(r["data"], r["dim"]) for r in rows} == expected
    for key in expected:
        nets = [r["model"] for r in rows if (r["data"], r["dim"]) == key]
        assert nets == ["explicit shallow", "explicit deep", "DEQ"]
    assert all(r["steps"] == QUICK.dkef_steps and r["repeats"] == QUICK.dkef_steps - 1 for r in rows)


def test_dkef_parameter_counts_match_fresh_nets(result):
    for row in _dkef_rows(result[1]):
        kind = {"explicit shallow": "shallow", "explicit deep": "deep", "DEQ": "deq"}[row["model"]]
        net = DKEF(row["dim"], QUICK.dkef_n_centres, QUICK.dkef_hidden, kind, QUICK.dkef_deep_layers)
        assert row["params"] == sum(p.numel() for p in net.parameters())


def test_dkef_memory_ordering_and_finite_results(result):
    rows = _dkef_rows(result[1])
    for key in {(r["data"], r["dim"]) for r in rows}:
        by = {r["model"]: r for r in rows if (r["data"], r["dim"]) == key}
        assert by["explicit deep"]["act_mib"] > by["explicit shallow"]["act_mib"] > 0
        assert by["explicit deep"]["act_mib"] > by["DEQ"]["act_mib"] > 0
        assert by["DEQ"]["solver_iters"] >= 1
        ratio = result[1]["sections"]["dkef"]["meta"]["ratios_deq_over_deep"][f"{key[0]} {key[1]}"]
        assert ratio["act_mib"] == pytest.approx(by["DEQ"]["act_mib"] / by["explicit deep"]["act_mib"])
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("test_ll", "log_z", "log_z_stderr", "final_loss"))
        # the reported standard error is the delta-method one of the reported effective sample size
        n = QUICK.dkef_log_z_samples if row["data"] == "highdim" else QUICK.dkef_log_z_samples_redwine
        assert row["log_z_stderr"] == pytest.approx(math.sqrt((n / row["ess"] - 1) / (n - 1)), rel=1e-6)
        if row["data"] == "highdim":  # the true N(0, I) quantities of the same test points
            # trained from its N(0, 2^2 I) base (score -x/4), the model must beat the base's Fisher divergence to
            # N(0, I), 0.5 E||3x/4||^2 = 9 D / 32
            assert 0 < row["fisher"] < 9 * row["dim"] / 32, row
            dm = UCIDataModule("highdim", dim=row["dim"], seed=QUICK.dkef_data_seed)
            dm.setup()
            assert row["true_ll"] == pytest.approx(dm.true_log_prob(dm.test_data).mean().item(), rel=1e-5)


def _dkef_step_memory(x: torch.Tensor, **deq_options) -> tuple[float, set[int]]:
    """Activation memory of one training step of a DEQ-DKEF and the iterations its solves ran."""
    net = build_dkef(QUICK, "deq", x.shape[1], tol=FORCED_TOL, warn_on_nonconvergence=False, **deq_options)
    net.init_centres(x, torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    mib = step_activation_mib(make_module(net, QUICK), x)
    return mib, {layer.stats.nstep for layer in net.modules() if isinstance(layer, DEQ)}


def test_dkef_deq_memory_is_independent_of_solver_iterations():
    dim, gen = 6, torch.Generator().manual_seed(0)
    x = torch.randn(QUICK.dkef_batch, dim, generator=gen)
    # a tolerance no solve meets (FORCED_TOL): exactly max_iter iterations per solve
    (few, it_few), (many, it_many) = (_dkef_step_memory(x, max_iter=n) for n in (4, 40))
    assert (it_few, it_many) == ({4}, {40})
    # the same storages whatever the iterations (the meter pins them: no address reuse can alias two of them)
    assert few == pytest.approx(many, rel=1e-9)
    # the same solves recorded for backward (unroll) grow with the iterations: the check above can fail
    unroll_few, unroll_many = (_dkef_step_memory(x, max_iter=n, backward="unroll")[0] for n in (4, 40))
    assert unroll_many > 2 * unroll_few > 2 * few
    # ... while an explicit net's grows with its depth
    deep = []
    for layers in (4, 16):
        net = build_dkef(replace(QUICK, dkef_deep_layers=layers), "deep", dim)
        net.init_centres(x, torch.Generator().manual_seed(0))
        torch.manual_seed(1)
        deep.append(step_activation_mib(make_module(net, QUICK), x))
    assert deep[1] > 2 * deep[0]


def test_ncsn_rows_cover_every_body_and_loss_with_ratios_to_ncsnv2(result):
    rows = _rows(result[1], "ncsn")
    steps = [r for r in rows if r.get("loss") and not r["model"].startswith("ratio")]
    assert {(r["model"], r["loss"]) for r in steps} == {
        (m, loss) for m in ("shallow explicit", "DEQ, phantom", "DEQ, IFT", "NCSNv2") for loss in QUICK.ncsn_losses
    } - {("DEQ, IFT", "annealed_ssm_vr")}  # IFT would give wrong SSM-VR gradients: not measured
    for r in steps:
        body = {"shallow explicit": "shallow", "NCSNv2": "ncsnv2"}.get(r["model"], "deq")
        assert r["params"] == sum(p.numel() for p in build_ncsn(QUICK, body, "phantom").parameters())
        assert r["act_mib"] > 0 and (r["solver_iters"] is not None) == (body == "deq")
    for r in (r for r in rows if r["model"].startswith("ratio")):
        body = next(s for s in steps if s["loss"] == r["loss"] and r["model"] == f"ratio {s['model']} / NCSNv2")
        ref = next(s for s in steps if s["loss"] == r["loss"] and s["model"] == "NCSNv2")
        assert r["act_mib"] == f"{body['act_mib'] / ref['act_mib']:.3f}x"
    # phantom and IFT save the same tensors in DSM (one re-attaching application each)
    dsm = {r["model"]: r for r in steps if r["loss"] == "annealed_dsm"}
    assert dsm["DEQ, IFT"]["act_mib"] == pytest.approx(dsm["DEQ, phantom"]["act_mib"], rel=0.05)
    sampling = [r for r in rows if "sample_s_per_image" in r]
    assert [r["model"] for r in sampling] == ["shallow explicit", "DEQ, phantom", "NCSNv2"]
    for r in sampling:
        evals = QUICK.ncsn_levels * QUICK.ncsn_langevin_steps + 1
        assert r["sample_s_per_image"] == pytest.approx(r["eval_ms_per_image"] * evals / 1e3)


def test_vae_rows_compare_explicit_and_deq_score_networks(result):
    rows = _rows(result[1], "vae")
    for arch, label, short in (("mlp", "MNIST MLP", "MNIST MLP"),
                               ("conv", f"{QUICK.vae_side}x{QUICK.vae_side} conv", "conv")):
        explicit, deq = (next(r for r in rows if r["model"] == f"{label}, {kind}") for kind in ("explicit", "deq"))
        for kind, r in (("explicit", explicit), ("deq", deq)):
            vae = build_vae(QUICK, arch, kind)
            assert r["score_params"] == sum(p.numel() for p in vae.score.parameters())
            assert r["params"] == sum(p.numel() for p in vae.parameters())
            assert r["act_mib"] > 0 and r["iteration_ms"] > 0 and (r["solver_iters"] is not None) == (kind == "deq")
        ratio = next(r for r in rows if r["model"] == f"ratio DEQ / explicit, {short}")
        assert ratio["act_mib"] == f"{deq['act_mib'] / explicit['act_mib']:.3f}x"


def test_the_ncsn_benchmark_takes_its_noise_schedule_from_the_config():
    from deqscore.bench.ncsn import config_sigmas
    from deqscore.bench.settings import FULL

    sigmas = config_sigmas(FULL)  # configs/ncsn/deq_cifar10.yaml: 50 -> 0.01 over 232 geometric levels
    assert len(sigmas) == 232 and float(sigmas[0]) == pytest.approx(50.0) and float(sigmas[-1]) == pytest.approx(0.01)
    ratios = sigmas[:-1] / sigmas[1:]
    assert torch.allclose(ratios, ratios[0].expand_as(ratios), rtol=1e-5)
    assert len(config_sigmas(QUICK)) == QUICK.ncsn_levels
