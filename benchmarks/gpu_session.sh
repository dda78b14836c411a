#!/usr/bin/env bash
# A lent GPU's checks in one call, sized for its 15 minutes of device time (docs/benchmarks.md, "A GPU
# session"): the GPU tests, then `python -m benchmarks --preset gpu-targets`.  Logs and tables go to
# $OUT (the device tool's folder; default gpu-session/): device.txt, pytest-gpu.txt, bench.txt and
# bench-gpu-targets.{json,md,png}.  Prepare the wheels here first: bash benchmarks/gpu_wheels.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-session}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ]; then   # installed beside the image's torch and triton, never over them
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/linattn-site \
        .whl/*.whl || { echo "error: the wheels in .whl/ did not install" >&2; exit 1; }
    export PYTHONPATH=/tmp/linattn-site:$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
} 2>&1 | tee "$out/device.txt"
timeout "${TESTS_S:-200}" python3 -m pytest -m gpu -q -n 0 -p no:cacheprovider 2>&1 | tee "$out/pytest-gpu.txt"
timeout "${BENCH_S:-330}" python3 -m benchmarks --preset gpu-targets --out "$out/bench-gpu-targets" --overwrite 2>&1 \
    | tee "$out/bench.txt"
