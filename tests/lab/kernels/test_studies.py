"""The kernel-regression command at a tiny budget: outputs, resumption, the pieces."""


import torch

from deqlab import main
from deqlab.kernels import regression as kernels


def test_kernel_regression_tiny_budget_writes_results_and_resumes(tmp_path, monkeypatch):
    argv = ["--n-train", "60", "--n-test", "40", "--depths", "1,3", "--out", str(tmp_path)]
    doc = main(["kernels", *argv])
    rows = doc["sections"]["kernel_regression"]["rows"]
    names = {(r["kernel"], r["depth"]) for r in rows}
    assert names == {("deq_ntk", None), ("deq_nngp", None), ("fc_ntk", 1), ("fc_ntk", 3), ("fc_nngp", 1),
                     ("fc_nngp", 3), ("inj_ntk", 1), ("inj_ntk", 3)}
    assert all(20 < r["accuracy"] <= 100 for r in rows)  # far above chance (10 %) even on 60 images
    for f in ("kernels.md", "kernels.json", "accuracy_vs_depth.png"):
        assert (tmp_path / f).stat().st_size > 0
    monkeypatch.setattr(kernels, "run_unit", lambda *a: (_ for _ in ()).throw(AssertionError("ran again")))
    assert main(["kernels", *argv])["sections"]["kernel_regression"]["rows"] == rows


def test_regression_interpolates_the_training_set():
    X, y, _, _ = kernels.mnist(50, 10)
    K = kernels.deq_ntk(X, X, 0.5, 0.3, 0.2)
    assert torch.equal(kernels.regress(K, K, y, 10, 0.0), y)
