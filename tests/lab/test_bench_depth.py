"""The depth section: explicit stacks of a DEQ's own block, DEQ memory flat in its solver iterations, the
effective depth from a short training run on real data, units recorded and read back."""

import json

import pytest
import torch

from deqlab import depth as bench_depth
from deqlab.settings import QUICK
from deqscore.deq import DEQ
from deqscore.metrics import parameter_count
from deqscore.models.nice import DEQMNet, NICEDEQMap


def test_untied_stack_applies_independent_copies_of_the_map_in_turn():
    torch.manual_seed(0)
    func = NICEDEQMap(6)
    stack = bench_depth.UntiedStack(func, depth=3)
    assert parameter_count(stack) == 3 * parameter_count(func)
    pairs = zip(stack.blocks, stack.blocks[1:], strict=False)
    assert all(not torch.equal(a.lin1.weight, b.lin1.weight) for a, b in pairs)
    u = torch.randn(4, 6)
    z = torch.zeros_like(u)
    for block in stack.blocks:
        z = block(z, u)
    torch.testing.assert_close(stack(u), z)


def test_untie_replaces_every_deq_layer_by_a_stack():
    net = torch.nn.Sequential(DEQMNet(4, 8, 4), DEQMNet(4, 8, 4))
    bench_depth.untie(net, 2)
    assert not any(isinstance(m, DEQ) for m in net.modules())
    assert sum(isinstance(m, bench_depth.UntiedStack) for m in net.modules()) == 2


@pytest.fixture(scope="module")
def depth_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("depth")
    families = {k: bench_depth.depth_families()[k] for k in ("nice", "ncsn")}  # one MLP and one conv family, real MNIST
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_depth, "depth_families", lambda: families)
        table = bench_depth.depth(QUICK.__class__(**{**QUICK.as_dict(), "out_dir": str(out)}), torch.device("cpu"))
    return out, table, families


def test_explicit_memory_grows_with_depth_and_the_deq_stays_flat(depth_run):
    _, table, families = depth_run
    for family in families.values():
        rows = [r for r in table.rows if r["family"] == family.label]
        explicit = [r["act_mib"] for r in rows if r["variant"] == "explicit"]
        assert all(a < b for a, b in zip(explicit, explicit[1:], strict=False))
        for k in bench_depth.PHANTOM_STEPS["quick"]:
            deq = [r["act_mib"] for r in rows if r.get("phantom_steps") == k]
            assert len(deq) == len(bench_depth.ITERATIONS["quick"]) and max(deq) == pytest.approx(min(deq), rel=1e-3)
        # K phantom steps record K applications of the map: as much as the explicit stack of depth K
        by_depth = {r["depth"]: r["act_mib"] for r in rows if r["variant"] == "explicit"}
        by_k = {r["phantom_steps"]: r["act_mib"] for r in rows if r.get("phantom_steps")}
        for k in set(by_depth) & set(by_k):
            assert by_k[k] == pytest.approx(by_depth[k], rel=0.1)


def test_effective_depth_is_measured_after_training_and_units_are_read_back(depth_run, monkeypatch):
    out, table, families = depth_run
    for family in families.values():
        eff = table.meta["effective_depth"][family.label]
        assert eff["converged"] and 1 <= eff["mean_iterations"] < bench_depth.EFFECTIVE_DEPTH_MAX_ITER
    assert all((out / f"depth_{name}.png").stat().st_size > 1000 for name in families)
    saved = json.loads((out / "depth_units" / "nice__rows.json").read_text())
    assert saved["value"] == [{k: v for k, v in r.items() if k != "family"} for r in table.rows
                              if r["family"] == families["nice"].label]

    def measured_again(*args, **kwargs):
        raise AssertionError("a recorded unit was measured again")

    monkeypatch.setattr(bench_depth, "depth_families", lambda: families)
    monkeypatch.setattr(bench_depth, "family_rows", measured_again)
    monkeypatch.setattr(bench_depth, "effective_depth", measured_again)
    again = bench_depth.depth(QUICK.__class__(**{**QUICK.as_dict(), "out_dir": str(out)}), torch.device("cpu"))
    assert again.rows == table.rows
