"""How many training iterations the CPU-scale NCSN needs to draw digits: one network of protocol v6's NCSN entry
(ngf 16, batch 64, Adam at the tuned 1e-3, 4 validation batches, the sampler's 20 steps per level), trained in
stages and scored after each by v6's digits check (KID of 200 samples of seed 0 from the trained weights against
the first 5,000 MNIST training images; "digits" is at most a tenth of the untrained control's KID, 0.594 on this
CPU). Each stage continues the last one's checkpoint, so the figures are those of one training run.

    OMP_NUM_THREADS=1 ARM=explicit STAGES=800,1600,2400,3200,4000 OUT=... \\
        python benchmarks/results/ncsn_cpu_pilot/digits.py

Writes ``digits_<arm>.json`` into ``$OUT`` after every stage (a stopped pilot keeps what it measured), with the
process CPU seconds of each stage's training and scoring, and each stage's grid as ``<arm>_<steps>.png``.
``STATS_ROOT`` names a folder of cached Inception statistics of the reference images (computed there if absent).
``AVERAGE_DECAY`` (say 0.99, an average over about 100 steps) trains with that decay of the weight average and scores
the average beside the trained weights at every stage, by the same check; the training is the same either way (the
average never feeds back into it). ``SCORE=average`` scores the average alone, for a training whose trained weights
an earlier pilot scored already. ``OPTIONS`` adds train.py options (space-separated, recorded with the fit options),
``STEP_SIZE`` samples with that base step size instead of the checkpoint's, and ``RUNS`` names the folder of the
training runs (default ``$OUT/runs``): an earlier pilot's, to score its checkpoints again with another sampler
(a stage its checkpoint has passed trains nothing).
"""
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

ARM = os.environ.get("ARM", "explicit")
STAGES = [int(s) for s in os.environ.get("STAGES", "800,1600,2400,3200,4000").split(",")]
OUT = Path(os.environ.get("OUT", Path(__file__).parent / "digits"))
STATS_ROOT = os.environ.get("STATS_ROOT", str(OUT / "fid_stats"))
AVERAGE_DECAY = os.environ.get("AVERAGE_DECAY")
SCORED = os.environ.get("SCORE", "trained,average" if AVERAGE_DECAY else "trained").split(",")
OPTIONS = os.environ.get("OPTIONS", "").split()
STEP_SIZE = os.environ.get("STEP_SIZE")
RUNS = Path(os.environ.get("RUNS", OUT / "runs"))
CONFIGS = {"explicit": "configs/ncsn/explicit_mnist.yaml", "deq": "configs/ncsn/deq_mnist.yaml",
           "ncsnv2": "configs/ncsn/ncsnv2_mnist.yaml"}


def refuse(message: str) -> None:
    """A usage error: one line, and the exit status of the project's commands for one (2)."""
    print(f"digits.py: {message}", file=sys.stderr)
    sys.exit(2)


if ARM not in CONFIGS:
    refuse(f"ARM={ARM!r}; one of {', '.join(CONFIGS)}")
# any other name would be scored as the average and recorded under its name
if not set(SCORED) <= {"trained", "average"} or ("average" in SCORED and not AVERAGE_DECAY):
    refuse(f"SCORE={','.join(SCORED)!r}; trained and/or average (average needs AVERAGE_DECAY)")
CONFIG = CONFIGS[ARM]
# the study unit's run options (seed 0, validation every tenth of v6's 800 iterations), v6's NCSN fit options, as
# the protocol states them, and the tuned rate
V6_FIT = json.loads(Path("benchmarks/protocol/v6.json").read_text())["families"]["ncsn"]["fit"]
FIT = ["--seed_everything=0", "--trainer.max_epochs=-1", "--trainer.val_check_interval=80",
       "--trainer.check_val_every_n_epoch=null", "--trainer.enable_progress_bar=false", *V6_FIT,
       "--optimizer.init_args.lr=0.001",
       *([f"--trainer.callbacks.ema.init_args.decay={AVERAGE_DECAY}"] if AVERAGE_DECAY else []), *OPTIONS]


def children_cpu_s() -> float:
    """Process CPU seconds of every finished child so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(command: list[str]) -> float:
    """Runs ``command`` with this interpreter; its process CPU seconds."""
    before = children_cpu_s()
    subprocess.run([sys.executable, *command], check=True)
    return children_cpu_s() - before


OUT.mkdir(parents=True, exist_ok=True)
name = f"ncsn_{ARM}"
record_path = OUT / f"digits_{ARM}.json"
record = json.loads(record_path.read_text()) if record_path.exists() else {
    "arm": ARM, "config": CONFIG, "fit": FIT, "average_decay": AVERAGE_DECAY, "samples": 200, "reference": 5000,
    "seed": 0, "step_size": STEP_SIZE, "stages": []}
# a record continues only under the options it was written with
if (record["fit"], record.get("step_size")) != (FIT, STEP_SIZE):
    refuse(f"{record_path} was written with other options or another STEP_SIZE; give another OUT")
done = {stage["steps"] for stage in record["stages"]}
for steps in STAGES:
    if steps in done:
        continue
    last = RUNS / name / "checkpoints" / "last.ckpt"
    train_s = run(["train.py", "fit", f"--config={CONFIG}", f"--run_name={name}", f"--runs_root={RUNS}", *FIT,
                   f"--trainer.max_steps={steps}", *([f"--ckpt_path={last}"] if last.exists() else [])])
    stage = {"steps": steps, "train_cpu_s": train_s}
    for weights in SCORED:
        samples = OUT / f"samples_{ARM}_{weights}"
        score_s = run(["sample.py", "--checkpoint", str(last), "--num-samples", "200", "--out", str(samples), "--seed",
                       "0", "--batch-size", "250", *(["--raw-weights"] if weights == "trained" else []),
                       *(["--step-size", STEP_SIZE] if STEP_SIZE else []), "--fid",
                       "--reference-images", "5000", "--stats-root", STATS_ROOT])
        report = json.loads((samples / "fid.json").read_text())
        suffix = "" if weights == "trained" else "_average"
        shutil.copy(samples / "samples.png", OUT / f"{ARM}_{steps}{suffix}.png")
        stage.update({f"kid{suffix}": report["kid"], f"kid_se{suffix}": report["kid_se"], f"fid{suffix}": report["fid"],
                      f"score_cpu_s{suffix}": score_s})
    record["stages"].append(stage)
    record_path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["stages"][-1]), flush=True)
