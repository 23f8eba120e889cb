"""``python -m deqlab gpu``: the one-line refusal without CUDA, the quick CPU run's rows and files, and the
KID standard error on feature sets whose answer is known. No timing is asserted."""

from __future__ import annotations

import json
import math

import pytest
import torch

from deqlab import gpu, gpu_images, main
from deqlab.gpu_images import IMAGE_FAMILIES, score
from deqlab.gpu_steps import family_entries, ratio_row
from deqscore.families import declarations

pytestmark = pytest.mark.xdist_group("bench_gpu")  # one worker runs the module, so its module fixture is built once


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        doc = main(["gpu", "--quick", "--out", str(out)])
    return out, doc


def test_without_cuda_it_stops_with_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main(["gpu", "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA" in err
    assert not any(tmp_path.iterdir())  # nothing written


def test_quick_run_writes_the_report_and_grids(quick_run):
    out, doc = quick_run
    assert json.loads((out / "gpu.json").read_text())["sections"].keys() == {"steps", "images"}
    md = (out / "gpu.md").read_text()
    assert "# deqscore GPU benchmark" in md and "device" in doc["header"]
    assert set(doc["header"]["stage seconds"]) == {"steps", "images"}
    for row in doc["sections"]["images"]["rows"]:
        assert (out / row["grid"]).stat().st_size > 0


def _is_outcome(value: object) -> bool:
    """A measured number, or a one-line reason why not."""
    if isinstance(value, str):
        return value.startswith(("failed: ", "skipped: ")) and "\n" not in value
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_step_rows_cover_every_family_with_both_networks_and_ratios(quick_run):
    _, doc = quick_run
    rows = doc["sections"]["steps"]["rows"]
    families = [name for name, _, _ in family_entries()]
    assert {"nice", "dkef", "vae", "ncsn"} <= set(families)
    for family in families:
        mine = {r["network"]: r for r in rows if r["family"] == family}
        assert set(mine) == {"explicit", "DEQ", "ratio DEQ / explicit"}
        for network in ("explicit", "DEQ"):
            assert isinstance(mine[network]["eager_ms"], float) and mine[network]["eager_ms"] > 0
            assert _is_outcome(mine[network]["compiled_ms"])
            assert mine[network]["params"] > 0
        assert mine["ratio DEQ / explicit"]["params"] == (
            f"{mine['DEQ']['params'] / mine['explicit']['params']:.3f}x")


def test_image_rows_train_sample_and_score_each_registered_family(quick_run):
    _, doc = quick_run
    table = doc["sections"]["images"]
    plan = gpu.IMAGES["quick"]
    known = declarations()
    for family in IMAGE_FAMILIES:
        rows = [r for r in table["rows"] if r["family"] == family.name]
        if family.name not in known:
            assert not rows and f"{family.name}: not a registered family here, skipped." in table["notes"]
            continue
        assert [r["network"] for r in rows] == ["untrained explicit (control)", "explicit", "DEQ"]
        for row in rows:
            assert row["samples"] == plan.samples and row["evaluations"] > 0
            assert 0 <= row["pixel_mean"] <= row["pixel_max_mean"] <= 1
        for row in rows[1:]:
            assert 1 <= row["steps"] <= plan.max_steps
            assert "digits" in row or row.get("kid") is None  # judged wherever the control was scored


def test_the_trained_weights_are_sampled_not_an_average_of_them(monkeypatch, tmp_path):
    """The sampler runs the very parameters the optimiser stepped (the study's rule since protocol v6), not a copy
    such as an average of them."""
    family = next(f for f in IMAGE_FAMILIES if f.name == "edm")
    optimisers, sampled = [], []

    def optimiser_kept(params, spec):
        optimisers.append(real_instantiate(params, spec))
        return optimisers[-1]

    def sample_kept(module, plan, device):
        sampled.extend(module.net.parameters())
        return real_sample(module, plan, device)

    real_instantiate, real_sample = gpu_images.instantiate_class, gpu_images.sample
    monkeypatch.setattr(gpu_images, "instantiate_class", optimiser_kept)
    monkeypatch.setattr(gpu_images, "sample", sample_kept)
    data = torch.rand(64, 784, generator=torch.Generator().manual_seed(0))
    record = gpu_images._one_network(family, "explicit", family.configs["explicit"], data, gpu.IMAGES["quick"],
                                     torch.device("cpu"), tmp_path, None, None)
    stepped = {id(p) for group in optimisers[0].param_groups for p in group["params"]}
    assert record["steps"] == gpu.IMAGES["quick"].max_steps and len(optimisers) == 1 and sampled
    assert all(id(p) in stepped for p in sampled)


def test_kid_and_its_standard_error_on_known_distributions():
    gen = torch.Generator().manual_seed(0)
    same_a, same_b = torch.randn(500, 16, generator=gen), torch.randn(500, 16, generator=gen)
    shifted = torch.randn(500, 16, generator=gen) + 1.0
    null = score(same_a, same_b, seed=0, fid=False)
    apart = score(shifted, same_b, seed=0, fid=False)
    assert abs(null["kid"]) < 4 * null["kid_se"] + 1e-3  # equal distributions: KID is unbiased, about 0
    assert apart["kid"] > 10 * apart["kid_se"] > 0  # a unit shift in every coordinate: clearly positive
    assert "fid" not in null and score(same_a, same_b, seed=0)["fid"] >= 0


def test_ratio_row_divides_numbers_and_leaves_failures_out():
    explicit = {"family": "f", "params": 10, "eager_ms": 2.0, "compiled_ms": "failed: x"}
    deq = {"family": "f", "params": 5, "eager_ms": 3.0, "compiled_ms": 1.0}
    row = ratio_row(explicit, deq)
    assert row["params"] == "0.500x" and row["eager_ms"] == "1.500x" and row["compiled_ms"] is None
