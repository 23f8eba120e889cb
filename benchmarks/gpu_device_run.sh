#!/bin/bash
# The device machine's run of `make gpu` from a carried folder (.gpurun: code, wheels, MNIST, Inception weights):
# install the carried wheels, upcast the float16 Inception weights to float32, run the program, copy results to $OUT.
# usage (from the folder holding deqscore/): bash benchmarks/gpu_device_run.sh [--quick]
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
cd "$(dirname "$0")/.." || exit 2
exec > >(tee "$OUT/log.txt") 2>&1
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ls whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl \
    && export PYTHONPATH=/tmp/site || echo "wheel install failed"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WEIGHTS=/tmp/inception_pool3_fp32.pth
if [ -f weights/inception_pool3_fp16.pt.xz ]; then
  $PY - <<'PY' || echo "inception weights: upcast failed"
import io, lzma, torch
with lzma.open("weights/inception_pool3_fp16.pt.xz") as f:
    sd = torch.load(io.BytesIO(f.read()))
sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
sd["fc.weight"] = torch.zeros(1008, 2048); sd["fc.bias"] = torch.zeros(1008)  # pool3 only: no classifier
torch.save(sd, "/tmp/inception_pool3_fp32.pth")
print("inception weights: float16 upcast to float32,", len(sd), "tensors")
PY
fi
ARGS=(--out "$OUT/gpu")
[ -f "$WEIGHTS" ] && ARGS+=(--inception-weights "$WEIGHTS")
time timeout -k 10 -s INT "${GPU_TIMEOUT:-450}" $PY -m deqlab gpu "${ARGS[@]}" "$@"
echo "exit $?"; date -u
ls -la "$OUT" "$OUT/gpu"
