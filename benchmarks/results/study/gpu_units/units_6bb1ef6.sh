# The image study's remaining arms on the lent machine, from a checkout of 6bb1ef6 (the code of the recorded GPU
# units: 498f12d with uncommitted changes whose SHA-256 is 6bb1ef6's diff). In /work/main, before the call:
#   rm -rf /tmp/study_main && cp -r benchmarks/results/study /tmp/study_main && git checkout -q --detach 6bb1ef6 &&
#   rm -rf benchmarks/results && mkdir -p benchmarks/results && cp -r /tmp/study_main benchmarks/results/study
# (the 64 MiB a call carries: the study folder alone); after it:
#   rm -rf benchmarks/results && git checkout -q -f main && tar xzf /work/.device/<n>/units.tgz
# .gpurun/images.py only runs with 6bb1ef6's lab (it has no --jobs of its own); ONLY picks the arms.
source .gpurun/setup.sh || exit 3
git log --oneline -1; git status --porcelain -- deqscore lab configs train.py sample.py | head
python3 .gpurun/images.py --only ${ONLY:-ncsn:deq,edm:explicit,edm:deq} --jobs ${JOBS:-16} --deadline ${DEADLINE:-430} \
    --grace ${GRACE:-90} --logs /tmp/unit_logs -- --out benchmarks/results/study --runs-root /tmp/study/runs 2>&1 | tee $OUT/driver.txt
tar czf $OUT/units.tgz benchmarks/results/study/ncsn benchmarks/results/study/edm
tar czf $OUT/logs.tgz -C /tmp unit_logs; ls -la $OUT; date -u
