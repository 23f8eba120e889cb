"""Kernel regression on MNIST with the DEQ-NTK, the DEQ-NNGP and finite-depth fully connected kernels.

Run::

    python -m deqlab kernels                                # n_train 1000, 2000, 5000; 2000 test images
    python -m deqlab kernels --n-train 200 --n-test 100 --depths 1,4 --out /tmp/k   # a smoke run

Images are flattened, centred by the training mean and scaled to unit norm (the kernels' inputs). Targets are
one-hot minus 0.1; the prediction is ``K(test, train) (K(train, train) + ridge n I)^-1 Y`` with ``--ridge``
(default 0: kernel interpolation; a near-singular system is solved by LU as it stands) and the class is the
arg-max. Kernels: ``deq_ntk`` and ``deq_nngp`` at ``sw2, su2, sb2`` (:mod:`deqlab.kernels`), ``fc_ntk`` /
``fc_nngp`` at each of ``--depths`` (finite depth, no injection: a plain deep ReLU net, whose kernel forgets its
input as depth grows) and ``inj_ntk`` at each depth (finite depth with injection, untied: it converges to the
DEQ-NTK). Each (kernel family, n_train) unit is recorded in ``<out>/units/`` and skipped on a re-run. Tables
(``kernels.md`` / ``.json``) and ``accuracy_vs_depth.png`` go to ``--out``.

Published anchors on the full training sets (MNIST's 60 000 images, CIFAR-10's 50 000): fully connected DEQ-NTK
about 98.6 % on MNIST and 59.8 % on CIFAR-10; subsets of a few thousand images score lower.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from deqlab.measure import environment, log
from deqlab.report import Column, Result, Table, write_result
from deqlab.units import recorded
from deqscore.sampling import pyplot

from ..kernels import deq_nngp, deq_ntk, finite_depth_kernels

Tensor = torch.Tensor
DEFAULT_OUT = "benchmarks/results/kernels"


def mnist(n_train: int, n_test: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Seeded subsets of MNIST-train and MNIST-test: unit-norm float64 rows (centred by the training mean) and
    integer labels."""
    from deqscore.data.mnist import load_mnist

    xs, ys = load_mnist("datasets", train=True, sources=("torchvision", "pureml"))
    xt, yt = load_mnist("datasets", train=False, sources=("torchvision", "pureml"))
    gen = torch.Generator().manual_seed(seed)
    i = torch.randperm(len(xs), generator=gen)[:n_train].numpy()
    j = torch.randperm(len(xt), generator=gen)[:n_test].numpy()
    X = torch.from_numpy(xs[i]).reshape(n_train, -1).to(torch.float64) / 255
    T = torch.from_numpy(xt[j]).reshape(n_test, -1).to(torch.float64) / 255
    mean = X.mean(0)
    X, T = X - mean, T - mean
    return (X / X.norm(dim=1, keepdim=True), torch.from_numpy(ys[i]).long(),
            T / T.norm(dim=1, keepdim=True), torch.from_numpy(yt[j]).long())


def regress(K_train: Tensor, K_test: Tensor, labels: Tensor, n_classes: int, ridge: float) -> Tensor:
    """Predicted classes of kernel regression on one-hot - 0.1 targets.

    >>> K = torch.eye(2, dtype=torch.float64)
    >>> regress(K, K, torch.tensor([1, 0]), 2, 0.0).tolist()
    [1, 0]
    """
    n = len(K_train)
    Y = torch.nn.functional.one_hot(labels, n_classes).to(torch.float64) - 0.1
    A = K_train + ridge * n * torch.eye(n, dtype=K_train.dtype) if ridge else K_train
    return (K_test @ torch.linalg.solve(A, Y)).argmax(1)


def kernel_family(family: str, X: Tensor, T: Tensor, args: argparse.Namespace) -> dict[str, tuple[Tensor, Tensor]]:
    """``{kernel name: (K(train, train), K(test, train))}`` of one family."""
    v = (args.sw2, args.su2, args.sb2)
    if family == "deq":
        return {"deq_ntk": (deq_ntk(X, X, *v), deq_ntk(T, X, *v)),
                "deq_nngp": (deq_nngp(X, X, *v), deq_nngp(T, X, *v))}
    injection = family == "inj"
    train = finite_depth_kernels(X, X, args.depths, *v, injection=injection)
    test = finite_depth_kernels(T, X, args.depths, *v, injection=injection)
    out = {}
    for L in args.depths:
        out[f"{family}_ntk_L{L}"] = (train[L][1], test[L][1])
        if not injection:
            out[f"{family}_nngp_L{L}"] = (train[L][0], test[L][0])
    return out


def run_unit(family: str, n_train: int, args: argparse.Namespace) -> list[dict]:
    X, y, T, yt = mnist(n_train, args.n_test, args.seed)
    start = time.perf_counter()
    rows = []
    for name, (K_train, K_test) in kernel_family(family, X, T, args).items():
        pred = regress(K_train, K_test, y, 10, args.ridge)
        kind, _, depth = name.partition("_L")
        rows.append({"kernel": kind, "depth": int(depth) if depth else None, "n_train": n_train,
                     "n_test": args.n_test, "accuracy": float((pred == yt).double().mean()) * 100})
    seconds = time.perf_counter() - start
    for r in rows:
        r["family_seconds"] = seconds
    return rows


def unit_settings(family: str, n_train: int, args: argparse.Namespace) -> dict:
    """What a unit's result depends on: a unit recorded with other settings is computed again."""
    return {"family": family, "n_train": n_train, "n_test": args.n_test, "seed": args.seed, "depths": args.depths,
            "sw2": args.sw2, "su2": args.su2, "sb2": args.sb2, "ridge": args.ridge, "dataset": args.dataset}


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every (kernel family, n_train) unit, each recorded under ``<out>/units`` (:func:`..units.recorded`)."""
    rows = []
    for n_train in args.n_train:
        for family in ("deq", "fc", "inj"):
            path = Path(args.out) / "units" / f"{family}_n{n_train}_t{args.n_test}_s{args.seed}.json"
            got = recorded(path, unit_settings(family, n_train, args),
                           lambda f=family, n=n_train: run_unit(f, n, args), device="cpu")
            rows += got
            log(f"{path.stem}: " + ", ".join(f"{r['kernel']}{'' if r['depth'] is None else r['depth']} "
                                            f"{r['accuracy']:.1f}%" for r in got))
    return rows


def plot(rows: list[dict], out: Path) -> list[str]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for n in sorted({r["n_train"] for r in rows}):
        for kind, style in (("fc_ntk", "-o"), ("fc_nngp", ":s"), ("inj_ntk", "--^")):
            rs = sorted((r for r in rows if r["n_train"] == n and r["kernel"] == kind), key=lambda r: r["depth"])
            if rs:
                line = ax.plot([r["depth"] for r in rs], [r["accuracy"] for r in rs], style, label=f"{kind} n={n}")[0]
                color = line.get_color()
        deq = [r for r in rows if r["n_train"] == n and r["kernel"] == "deq_ntk"]
        if deq:
            ax.axhline(deq[0]["accuracy"], color=color, lw=0.8, ls="-.", label=f"DEQ-NTK n={n}")
    ax.set(xscale="log", xlabel="depth L", ylabel="test accuracy (%)", title="MNIST kernel regression")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_depth.png", dpi=110)
    plt.close(fig)
    return ["accuracy_vs_depth.png"]


def write(rows: list[dict], args: argparse.Namespace, env: dict) -> dict:
    out = Path(args.out)
    table = Table("kernel_regression", "MNIST kernel regression: test accuracy (%)", [
        Column("n_train", "n train"), Column("kernel", "kernel"), Column("depth", "depth L"),
        Column("accuracy", "accuracy (%)", ".2f"), Column("n_test", "n test"),
        Column("family_seconds", "family s", ".0f"),
    ], sorted(rows, key=lambda r: (r["n_train"], r["kernel"], r["depth"] or 0)), notes=[
        f"sw2, su2, sb2 = {args.sw2}, {args.su2}, {args.sb2}; ridge {args.ridge} x n; subsets drawn with seed "
        f"{args.seed}; inputs centred by the training mean and scaled to unit norm; targets one-hot - 0.1.",
        "fc: finite depth without injection (a plain ReLU net, layers of weight variance 1); inj: finite depth "
        "with injection and untied weights (tends to the DEQ-NTK). family s: seconds for all kernels of the row's "
        "family (construction and solves).",
    ])
    pngs = plot(rows, out)
    return write_result(out, "kernels", Result("Kernel regression with DEQ kernels (MNIST subsets)", env, vars(args),
                                               [table], plots=pngs))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="mnist", choices=["mnist"],
                        help="mnist (CIFAR-10 is not stored locally)")
    parser.add_argument("--n-train", default="1000,2000,5000", help="comma-separated training-subset sizes")
    parser.add_argument("--n-test", type=int, default=2000)
    parser.add_argument("--depths", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--sw2", type=float, default=0.5)
    parser.add_argument("--su2", type=float, default=0.3)
    parser.add_argument("--sb2", type=float, default=0.2)
    parser.add_argument("--ridge", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=DEFAULT_OUT)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The kernel regressions ``args`` asks for (resumed from the units on disk) and their report."""
    args.n_train = [int(v) for v in args.n_train.split(",") if v]
    args.depths = [int(v) for v in args.depths.split(",") if v]
    torch.set_num_threads(args.threads)
    env = environment(torch.device("cpu"))
    return write(run_all(args), args, env)
