"""The study page's figures, from the recorded units: learning curves (mean over seeds with a standard-error band)
and the test metric against activation memory."""

from __future__ import annotations

from pathlib import Path

from deqscore.sampling import pyplot

from .core import Family, Metric, seed_curve


def plot_curves(family: Family, units: list[dict], group: str, path: Path) -> None:
    """Training and validation loss against the training iteration, mean over seeds with a standard-error band."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key in zip(axes, ("train/loss", "val/loss"), strict=True):
        for name, variant in family.variants.items():
            runs = [u["value"] for u in units if u["group"] == group and u["variant"] == name]
            curve = seed_curve(runs, key)
            if not curve:
                continue
            per_iteration = runs[0]["optimiser_steps"] / runs[0]["iterations"]
            stats = list(curve.values())
            xs = [t / per_iteration for t in curve]
            mean = [m for m, _ in stats]
            err = [e or 0.0 for _, e in stats]
            ax.plot(xs, mean, label=f"{name} ({variant.role})")
            ax.fill_between(xs, [m - e for m, e in zip(mean, err, strict=True)],
                            [m + e for m, e in zip(mean, err, strict=True)], alpha=0.25)
        ax.set_title(f"{family.title}, {group}: {key}")
        ax.set_xlabel("training iteration")
        ax.set_yscale("symlog")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_quality_memory(family: Family, metric: Metric, summaries: list[dict], path: Path) -> None:
    """The judged ``metric`` against activation memory per step: one point per variant with its standard
    error, one panel per data set."""
    plt = pyplot()
    groups = list(dict.fromkeys(s["group"] for s in summaries))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, group in zip(axes[0], groups, strict=True):
        for s in (s for s in summaries if s["group"] == group):
            if metric.key not in s or "activation_memory_mb" not in s:
                continue
            y = s[metric.key]
            ax.errorbar(s["activation_memory_mb"]["mean"], y["mean"], yerr=y["stderr"] or 0.0, fmt="o", capsize=3,
                        label=f"{s['variant']} ({family.variants[s['variant']].role})")
        ax.set_xscale("log")
        ax.set_xlabel("activation memory per step (MiB)")
        ax.set_ylabel(f"{metric.label} ({'higher' if metric.higher_is_better else 'lower'} is better)")
        ax.set_title(f"{family.title}: {group}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
