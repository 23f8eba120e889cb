#!/bin/bash
# The CPU families' study units in the background, on the study's 2-core machine: one process with one torch
# thread per family (niced; JOBS of them for one family), each at the commit its recorded units ran at, in a git
# worktree beside this checkout, so that a comparison's arms share their code. A recorded unit is read back, not
# run again, so starting again after a stop goes on where it stopped.
#   bash benchmarks/results/study/cpu_units.sh start dkef nice   # worktrees (made once), then one chain a family
#   bash benchmarks/results/study/cpu_units.sh collect dkef nice # the worktrees' unit files here, then the page
#   JOBS=2 bash benchmarks/results/study/cpu_units.sh start edm  # one family on both cores: its units two at a time
# Logs: ../units_<family>.log. A chain's progress: ls ../units_<family>/benchmarks/results/study/<family>/*/
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
PY=${PY:-$ROOT/.venv/bin/python}
JOBS=${JOBS:-1}  # a family's units at once, each on one thread (deqlab study --jobs, from protocol v6's commits on)
[[ $JOBS =~ ^[1-9][0-9]*$ ]] || { echo "cpu_units.sh: JOBS=$JOBS; a number of processes, at least 1" >&2; exit 2; }
PARALLEL=(); [ "$JOBS" -gt 1 ] && PARALLEL=(--jobs "$JOBS")
RESULTS=benchmarks/results/study

# the commit of a family's recorded units, and the arms its chain runs under protocol v6, the last it ran for DKEF,
# NICE and the VAE, whose every arm is recorded (a start reads them back and runs nothing); the image families: every
# arm on the CPU at one commit, the first whose weight averaging keeps the trained weights in the checkpoint saved
# after fit, the one a unit scores (v6 scores the trained weights; earlier commits scored their average there)
# NCSN's chain runs under protocol v7 (3,200 iterations, the average with decay 0.99, step 1e-4, the Anderson
# backward), from the commit whose ELU and max-pool take about 0.75x the step of torch's CPU kernels with the same
# values (docs/benchmarks.md; v7 was written at cbb6ce4, where its untrained controls first ran: kept in the log)
declare -A COMMIT=([dkef]=72f9b85 [nice]=51e2352 [vae]=e779b85 [ncsn]=b0cebc0 [edm]=0b28484)
declare -A ARMS=([dkef]=deq_reference [nice]=deq_reference
                 [vae]=deq,deq_faithful,explicit_deep,gaussian [ncsn]=untrained,explicit,deq,ncsnv2
                 [edm]=untrained,explicit,deq)

action=${1:-}; shift || true
[ -n "$action" ] && [ $# -gt 0 ] || { echo "usage: cpu_units.sh start|collect FAMILY... (of: ${!COMMIT[*]})" >&2; exit 2; }
for family in "$@"; do
  [ -n "${COMMIT[$family]:-}" ] || { echo "cpu_units.sh: no chain for family '$family' (of: ${!COMMIT[*]})" >&2; exit 2; }
  tree=$(dirname "$ROOT")/units_$family
  case $action in
    start)
      if pgrep -f "deqlab study --family $family( |$)" > /dev/null; then  # a chain of this script's or a hand-started one
        echo "cpu_units.sh: $family's chain is already running (pgrep -af 'deqlab study --family $family')" >&2; exit 2
      fi
      if [ ! -d "$tree" ]; then
        git -C "$ROOT" worktree add -q --detach "$tree" "${COMMIT[$family]}"
        rm -rf "${tree:?}/$RESULTS/$family" && cp -a "$ROOT/$RESULTS/$family" "$tree/$RESULTS/"
      fi
      # an older commit may lack the rule that keeps an earlier design's unit under <data>/v<version>/ when a
      # unit of the newer design takes its place: apply this checkout's rule to the arms about to run
      PYTHONPATH="$ROOT/lab" "$PY" -c 'import json, sys; from pathlib import Path
from deqlab.study.core import keep_earlier; from deqlab.study.protocol import load
protocol = load(); arms = sys.argv[2].split(",")
for unit in sorted(Path(sys.argv[1]).glob("*/*_s*.json")):
    if json.loads(unit.read_text())["variant"] in arms: keep_earlier(unit, unit.parent, protocol)' \
        "$tree/$RESULTS/$family" "${ARMS[$family]}"
      (cd "$tree" && OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH="$tree:$tree/lab" \
        nohup nice -n 19 "$PY" -m deqlab study --family "$family" --variants "${ARMS[$family]}" \
        "${PARALLEL[@]}" >> "$tree.log" 2>&1 &)
      echo "$family: started at ${COMMIT[$family]} in $tree, $JOBS unit(s) at once (log $tree.log)" ;;
    collect)  # the worktree's unit folders, copied from this one at the start, are the family's record: mirror
      # them; the figures beside them are the page's, which this checkout's report draws (the worktree's commit may
      # draw them under another protocol's name)
      [ -d "$tree/$RESULTS/$family" ] || { echo "cpu_units.sh: no worktree $tree to collect from (start it first)" >&2
                                           exit 2; }
      find "${ROOT:?}/$RESULTS/$family" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
      cp -a "$tree/$RESULTS/$family"/*/ "$ROOT/$RESULTS/$family/" ;;
    *) echo "cpu_units.sh: unknown action '$action' (start or collect)" >&2; exit 2 ;;
  esac
done
if [ "$action" = collect ]; then
  cd "$ROOT" && "$PY" -m deqlab study --report
fi
