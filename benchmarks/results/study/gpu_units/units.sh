# The image families' study units on the lent machine (python3's torch, 16 cores, one thread a unit process).
# Before the call, move benchmarks/results aside but for its study/ folder (the 64 MiB a call carries); the units
# are recorded in benchmarks/results/study as the study records them (recorded ones are read back) and come back
# in units.tgz: unpack it in the repository's root.
source .gpurun/setup.sh || exit 3
git log --oneline -1; git status --porcelain -- deqscore lab configs train.py sample.py | head
STUDY="python3 -m deqlab study --out benchmarks/results/study --runs-root /tmp/study/runs"
timeout -s INT ${LIMIT:-540} $STUDY --family ncsn,edm --jobs ${JOBS:-15} --stop-after ${STOP:-420} 2>&1 | tee $OUT/driver.txt &
# the run-to-run spread, once the shallow networks' tuning is recorded (about 4 minutes in: read back, not run again)
(sleep 240; timeout -s INT $((${LIMIT:-540} - 240)) $STUDY --family ncsn,edm --variants explicit --seeds 0 --rerun \
    > $OUT/rerun.txt 2>&1) &
wait
tar czf $OUT/units.tgz benchmarks/results/study/ncsn benchmarks/results/study/edm
tar czf $OUT/logs.tgz -C /tmp/study/runs jobs; ls -la $OUT; date -u
