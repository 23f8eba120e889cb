"""The GPU program's image stage: each image family's explicit and DEQ networks trained on MNIST at the configs'
full scale for a fixed time budget, then sampled with the configs' sampler and scored by KID (and FID@N) against the
held-out MNIST test images, with a sample grid each and the untrained explicit network as the control.

The families are the entries of :data:`IMAGE_FAMILIES`; one whose name is not a declared family is skipped with a
one-line note, so a new family joins by one entry. Training is the module's own loss (``loss_terms``) with the
config's optimiser; batches are drawn uniformly from the 60,000 training images held on the device. The trained
weights are sampled and scored, not the configs' average of them: over the few thousand steps a time budget
allows, an average of decay 0.999 spans a third or more of the run and lags the trained weights, most at the small
noise levels that draw the strokes (the study's rule since protocol v6, after its CPU pilot).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pytorch_lightning.cli import instantiate_class

from deqscore.data.mnist import load_mnist
from deqscore.data.transforms import preprocess
from deqscore.families import declarations
from deqscore.metrics.inception import InceptionFeatures
from deqscore.metrics.quality import KID_BLOCKS, kernel_inception_distance
from deqscore.metrics.statistics import FeatureStats, frechet_distance
from deqscore.sampling.grid import save_image_grid

from .configs import Options, build, read_config
from .gpu_steps import one_line
from .measure import log, wall
from .report import Column, Table

DIGITS_FACTOR = 0.1  # "draws digits": KID at most this times the untrained network's, through the same sampler


@dataclass(frozen=True)
class ImageFamily:
    """A family trained to digits: its name (a declared family), its MNIST configs, and the options that shrink
    them to seconds on a CPU (the quick run)."""

    name: str
    configs: dict[str, str]  # "explicit" / "DEQ" -> config, relative to the repository
    options: Options = field(default_factory=dict)  # what the data module would set (the image size), and quiet
    quick: dict[str, Options] = field(default_factory=dict)  # per network, on top of ``options`` in the quick run


_NCSN_QUICK = {"net.ngf": 4, "n_levels": 3, "sampler.n_steps_each": 2}
_EDM_QUICK = {"net.ngf": 4, "sampler.num_steps": 2}
IMAGE_FAMILIES = (
    ImageFamily("ncsn", {"explicit": "configs/ncsn/explicit_mnist.yaml", "DEQ": "configs/ncsn/deq_mnist.yaml"},
                {"net.dim": 784, "sampler.progress": False},
                {"explicit": _NCSN_QUICK, "DEQ": {**_NCSN_QUICK, "net.deq.max_iter": 8}}),
    ImageFamily("edm", {"explicit": "configs/edm/explicit_mnist.yaml", "DEQ": "configs/edm/deq_mnist.yaml"},
                {"net.dim": 784, "sampler.progress": False},
                {"explicit": _EDM_QUICK, "DEQ": {**_EDM_QUICK, "net.deq.max_iter": 8}}),
)


@dataclass(frozen=True)
class ImagePlan:
    """Budgets and sizes of the image stage."""

    quick: bool
    train_s: dict[str, float]  # per network ("explicit", "DEQ"): training stops at this many seconds
    max_steps: int
    sample_s: float  # the number of samples is cut so that sampling one network fits in about this
    samples: int
    min_samples: int
    reference: int  # held-out test images for the reference features
    fid: bool = True  # FID@N too (a 2048 x 2048 matrix square root per network)
    seed: int = 0


def _mnist(train: bool, n: int | None = None) -> torch.Tensor:
    images, _ = load_mnist("datasets", train=train, sources=("torchvision", "pureml"))
    batch = torch.from_numpy(images[:n]).reshape(len(images[:n]), -1)
    return preprocess(batch, "pixels")


def train(module, config: str, data: torch.Tensor, plan: ImagePlan, budget_s: float) -> dict:
    """Train ``module`` in place on random batches of ``data`` for ``budget_s`` seconds (or ``max_steps``); the
    training record."""
    spec = read_config(config)
    optimizer = instantiate_class(module.parameters(), spec["optimizer"])
    batch = ((spec.get("data") or {}).get("init_args") or {}).get("batch_size", 128)
    batch = min(batch, 8) if plan.quick else batch
    gen = torch.Generator(device=data.device).manual_seed(plan.seed)
    module.train()
    start, steps, losses = time.perf_counter(), 0, []
    while steps < plan.max_steps and time.perf_counter() - start < budget_s:
        x = data[torch.randint(len(data), (batch,), device=data.device, generator=gen)]
        optimizer.zero_grad(set_to_none=True)
        loss = module.loss_terms(x)["loss"]
        loss.backward()
        optimizer.step()
        steps += 1
        if steps % 100 == 0 or steps < 3:
            losses.append(float(loss.detach()))  # a host sync every 100 steps keeps the clock honest
    if data.device.type == "cuda":
        torch.cuda.synchronize(data.device)
    seconds = time.perf_counter() - start
    log(f"gpu images: trained {steps} steps in {seconds:.0f} s, loss {losses[-1] if losses else float('nan'):.3g}")
    return {"steps": steps, "train_s": seconds, "batch": batch, "last_loss": losses[-1] if losses else None,
            "ms_per_step": 1e3 * seconds / max(steps, 1)}


def sample(module, plan: ImagePlan, device: torch.device) -> tuple[torch.Tensor, dict]:
    """Samples of ``module`` through its sampler, as many as fit the sampling budget (estimated from one cold
    network evaluation per sampler step), as images ``[n, C, H, W]`` in [0, 1]."""
    evaluations, middle = _sampler_schedule(module)
    module.eval()
    probe = torch.rand(plan.samples, module.net.dim, device=device)
    level = torch.full((plan.samples,), middle, device=device)
    with torch.no_grad():
        _, eval_s = wall(lambda: module.net(probe, level), device)
    estimate = eval_s * evaluations
    n = plan.samples
    if estimate > plan.sample_s:
        n = max(plan.min_samples, int(plan.samples * plan.sample_s / estimate) // 50 * 50)
    generator = torch.Generator(device=device).manual_seed(plan.seed)
    flat, seconds = wall(lambda: module.sample(n, generator=generator), device)
    images = flat.clamp(0, 1).reshape(n, *module.net.image_shape)
    log(f"gpu images: {n} samples x {evaluations} evaluations in {seconds:.0f} s")
    return images, {"samples": n, "evaluations": evaluations, "sample_s": seconds,
                    "pixel_max_mean": float(images.flatten(1).amax(1).mean()),
                    "pixel_mean": float(images.mean())}


def _sampler_schedule(module) -> tuple[int, float]:
    """Network evaluations per sample of ``module``'s sampler and a noise level in the middle of its schedule: a
    sampler that states its evaluations and levels (EDM's Heun) says both; annealed Langevin runs ``n_steps_each``
    steps at each of the module's levels (and a final denoising step where it has one)."""
    sampler = module.sampler
    if hasattr(sampler, "evaluations"):
        levels = sampler.sigmas()[:-1]  # the last level is 0, never evaluated
        return sampler.evaluations, float(levels[len(levels) // 2])
    evaluations = len(module.sigmas) * sampler.n_steps_each + int(getattr(sampler, "final_denoise", False))
    return evaluations, float(module.sigmas[len(module.sigmas) // 2])


def score(features: torch.Tensor, reference: torch.Tensor, seed: int, fid: bool = True) -> dict:
    """KID (the project's protocol: 100 subsets), its standard error over :data:`KID_BLOCKS` disjoint sample blocks
    (:func:`~deqscore.metrics.quality.kid_standard_error`), and FID@N."""
    kid = kernel_inception_distance(features, reference, seed=seed)
    out = {"kid": kid["kid"], "kid_se": kid["kid_se"], "kid_subset_size": kid["kid_subset_size"]}
    if fid:
        a, b = FeatureStats(features.shape[1]), FeatureStats(features.shape[1])
        a.update(features)
        b.update(reference)
        out["fid"] = frechet_distance(a, b)
    return out


def image_table(plan: ImagePlan, device: torch.device, out_dir: Path, inception: str | None) -> Table:
    """Train, sample and score every registered family of :data:`IMAGE_FAMILIES`; a failing network is a row."""
    table = Table("images", "Image families trained to digits on MNIST: steps reached, KID against held-out MNIST", [
        Column("family", "family"), Column("network", "network"), Column("steps", "steps"),
        Column("ms_per_step", "ms / step", ".1f"), Column("last_loss", "last loss", ".3g"),
        Column("samples", "samples"), Column("sample_s", "sampling (s)", ".0f"),
        Column("kid", "KID", ".4f"), Column("kid_se", "KID std. error", ".4f"), Column("fid", "FID@N", ".1f"),
        Column("pixel_max_mean", "mean max pixel", ".2f"), Column("digits", "digits (KID <= 0.1 x control)"),
        Column("grid", "grid"),
    ])
    known = declarations()
    families = [f for f in IMAGE_FAMILIES if f.name in known]
    table.notes += [f"{f.name}: not a registered family here, skipped." for f in IMAGE_FAMILIES if f.name not in known]
    if not families:
        return table
    data = _mnist(True).to(device)
    extractor, reference = None, None
    try:
        extractor = InceptionFeatures(inception).to(device)
        reference = extractor(_mnist(False, plan.reference).reshape(-1, 1, 28, 28).to(device))
    except Exception as err:  # noqa: BLE001 - no Inception: the samples and grids still come out
        table.notes.append(f"KID/FID not computed: {one_line(err)}")
    for family in families:
        control = None
        for label, config in (("untrained explicit (control)", family.configs["explicit"]), *family.configs.items()):
            row = {"family": family.name, "network": label}
            try:
                row |= _one_network(family, label, config, data, plan, device, out_dir, extractor, reference)
            except Exception as err:  # noqa: BLE001 - one network's failure leaves the others
                row["steps"] = one_line(err)
            log(f"gpu images: {family.name} {label}: KID {row.get('kid')} +- {row.get('kid_se')}, "
                f"steps {row.get('steps')}")
            if label.startswith("untrained"):
                control = row.get("kid")
            elif control is not None and row.get("kid") is not None:
                row["digits"] = row["kid"] <= DIGITS_FACTOR * control
            table.rows.append(row)
    table.notes += [
        f"Training: the config's module, optimiser and batch ({'shrunk: quick run' if plan.quick else 'full scale'}),"
        " random batches of the 60,000 MNIST training images (k/255) on the device; "
        f"training stops at its time budget ({plan.train_s}) or {plan.max_steps} steps. Sampling: the config's "
        "sampler on the trained weights, not their average (DEQ solves warm-started along the chain), as many "
        "samples as fit "
        f"{plan.sample_s:.0f} s (at most {plan.samples}), seed {plan.seed}.",
        f"KID: Inception pool3 features, unbiased cubic-kernel MMD^2, 100 subsets, against the first {plan.reference}"
        f" MNIST test images; std. error over {KID_BLOCKS} disjoint sample blocks. FID@N is biased upwards at "
        "N < 2048 (comparable only at equal N). The control is the untrained explicit network through the same "
        f"sampler; 'digits' means KID <= {DIGITS_FACTOR} x the control's.",
    ]
    return table


def _one_network(family: ImageFamily, label: str, config: str, data: torch.Tensor, plan: ImagePlan,
                 device: torch.device, out_dir: Path, extractor, reference) -> dict:
    network = "explicit" if label.startswith("untrained") else label
    module = build(config, {**family.options, **(family.quick.get(network, {}) if plan.quick else {})}).to(device)
    record: dict = {"config": config}
    if not label.startswith("untrained"):
        record |= train(module, config, data, plan, plan.train_s[label])
    images, record_sample = sample(module, plan, device)
    record |= record_sample
    grid = out_dir / f"{family.name}_{label.split()[0].lower()}.png"
    save_image_grid(images[:64], grid, nrow=8)
    record["grid"] = grid.name
    if extractor is not None:
        record |= score(extractor(images), reference, plan.seed, plan.fid)
    return record
