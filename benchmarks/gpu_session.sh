#!/usr/bin/env bash
# A lent GPU's checks in one call, sized for its 15 minutes of device time (docs/benchmarks.md, "A GPU
# session"): the GPU tests, then `python -m benchmarks --preset gpu-targets`, and, when GAP_S > 0 (a
# second call: TESTS_S=0 BENCH_S=0 GAP_S=400), `--preset gap-closers` on fla in bf16.  A stage whose
# limit is 0 is skipped.  Logs and tables go to $OUT (the device tool's folder; default gpu-session/):
# device.txt, pytest-gpu.txt, bench.txt, bench-gpu-targets.{json,md,png}, bench-gap.txt and
# bench-gap-closers-gpu.{json,md}.  Prepare the wheels here first: bash benchmarks/gpu_wheels.sh.
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
status=0
stage() {   # stage LIMIT_S LOG COMMAND...: the command under `timeout LIMIT_S`, its output also in $out/LOG
    local limit=$1 log=$2
    shift 2
    [ "$limit" -gt 0 ] || return 0
    timeout "$limit" "$@" 2>&1 | tee "$out/$log" || status=$?
}
stage "${TESTS_S:-200}" pytest-gpu.txt python3 -m pytest -m gpu -q -n 0 -p no:cacheprovider
stage "${BENCH_S:-330}" bench.txt python3 -m benchmarks --preset gpu-targets --out "$out/bench-gpu-targets" --overwrite
stage "${GAP_S:-0}" bench-gap.txt python3 -m benchmarks --preset gap-closers --device cuda --dtypes bf16 \
    --lengths 4096,16384,65536 --out "$out/bench-gap-closers-gpu" --overwrite
exit $status   # the last failing stage's status; each stage's log says more
