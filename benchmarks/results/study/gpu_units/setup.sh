# The lent machine's set-up for the study's units: the carried wheels, MNIST and FID Inception weights.
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpurun/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD:$PWD/lab PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
mkdir -p datasets && cp -r .gpurun/MNIST datasets/
python3 -c "
import torch, pathlib
hub = pathlib.Path(torch.hub.get_dir()) / 'checkpoints'; hub.mkdir(parents=True, exist_ok=True)
sd = torch.load('.gpurun/inc/inception_fp16.pth')
torch.save({k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}, hub / 'weights-inception-2015-12-05-6726825d.pth')
print('inception: float16 upcast to float32,', len(sd), 'tensors; torch', torch.__version__)"
