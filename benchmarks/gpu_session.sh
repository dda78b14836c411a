#!/usr/bin/env bash
# A lent GPU's checks in one call that fits its slot (docs/benchmarks.md, "A GPU session"):
#   bash benchmarks/gpu_session.sh [--dry-run] [OUT]
# Stages, each under `timeout` with its own limit, their limits summing to at most BUDGET_S (580 s); their
# files are packed into OUT/session.tgz (OUT: default $OUT, else gpu-session/):
#   setup     install the carried wheels (.whl/, bash benchmarks/gpu_wheels.sh) and record the versions
#   gpu_tests `pytest -m gpu` (bf16 accuracy at 64k apart), six processes: the tests' blocks share fla's
#             autotuning keys with the measured ones, so they also fill Triton's cache (.gpu-cache/)
#   warm      fla autotunes what the tests did not (three processes side by side); the cache, autotune
#             results included, is saved as OUT/gpu-cache.tgz for a later run to carry in
#   blocks    the block table in bf16 at 4k / 16k / 64k: softmax, the window-only control, FAVOR+ `post` and
#             `pre` plain and with a window of 64, `pre` with RetNet's decay, elu `post`
# Then, within what is left of BUDGET_S: accuracy (the block in bf16 against float64 at 16k and 64k),
# kernels (the op against chunk_gla at M = 64 and 256), profile (torch.profiler, FAVOR+ post at 64k beside
# a bare chunk_gla) and the model section.  A stage that would end past the budget is skipped and says so.
# --dry-run (on CPU) prints each stage's limit and command, checks that the command parses (pytest collects
# its tests, the benchmark takes its flags) and that the limits fit the budget.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
out=${1:-${OUT:-gpu-session}}
budget=${BUDGET_S:-580}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$PWD/.gpu-cache
pytest_gpu="python3 -m pytest -m gpu -v -rfE --durations=15 -o faulthandler_timeout=150 -p no:cacheprovider"
bench="python3 -m benchmarks --device cuda --dtypes bf16 --overwrite"
lengths="--lengths 4096,16384,65536"   # the block and kernels sections'; the model section has its contexts
parse="python3 -c 'import sys; from benchmarks.settings import parse_settings; parse_settings(sys.argv[1:])'"
declare -A run check flags
# the budgeted stages in order, "name limit_s", then those that take what is left
stages=("setup 25" "gpu_tests 200" "warm 100" "blocks 160")
later=("accuracy 110" "kernels 90" "profile 40" "model 300")
run[setup]="if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
--target /tmp/linattn-site .whl/*.whl || { echo 'error: the wheels in .whl/ did not install'; exit 1; }; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c \"import torch, triton, fla; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'fla', fla.__version__)\""
check[setup]="bash -n $0"
warm="python3 -m benchmarks.gpu_checks warm"
run[warm]="$warm blocks & first=\$!; $warm options & second=\$!; $warm kernels && wait \$first && wait \$second \
&& { [ ! -d .gpu-cache ] || tar -czf $out/gpu-cache.tgz .gpu-cache; }"
check[warm]="$warm blocks --check && $warm options --check && $warm kernels --check"
run[accuracy]="$pytest_gpu -n 0 -s tests/linattn/ops/linear_attention/test_fla_kernels_bf16.py"
run[profile]="python3 -m benchmarks.gpu_checks profile --length 65536 --out $out/profile.txt"
flags[blocks]="$lengths --sections block --block-methods softmax,softmax+window=64,favor-post,favor-post+window=64,\
favor-pre,favor-pre+window=64,favor-pre+decay=retnet,elu-post --out $out/blocks"
flags[kernels]="$lengths --sections kernels --kernel-methods linattn-fla-log,fla-gla --kernel-features 64,256 \
--out $out/kernels"
flags[model]="--preset gpu-targets --sections model --out $out/model"
run[gpu_tests]="$pytest_gpu -n 6 --deselect tests/linattn/ops/linear_attention/test_fla_kernels_bf16.py"
for name in accuracy gpu_tests; do check[$name]="${run[$name]} --collect-only | grep -q 'collected'"; done
check[profile]="${run[profile]} --check"
for name in blocks kernels model; do
    run[$name]="$bench ${flags[$name]}"
    check[$name]="$parse ${run[$name]#python3 -m benchmarks } --device cpu"   # the flags, on this machine
done

status=0
total=0
for stage in "${stages[@]}"; do total=$((total + ${stage#* })); done
if [ $dry = 1 ]; then
    if [ $total -gt "$budget" ]; then   # before any stage is checked: the plan itself does not fit
        echo "budgeted stages: $total s, over the budget of $budget s"
        exit 1
    fi
    declare -A checking
    for stage in "${stages[@]}" "${later[@]}"; do   # side by side: pytest's collection takes a while
        name=${stage% *}
        bash -c "${check[$name]}" >"$out/dry-run-$name.txt" 2>&1 & checking[$name]=$!
    done
    for stage in "${stages[@]}" "${later[@]}"; do
        name=${stage% *}
        if wait "${checking[$name]}"; then verdict=ok; else verdict=FAILED; status=1; fi
        printf '%-9s %4s s  %-6s %s\n' "$name" "${stage#* }" "$verdict" "$(echo "${run[$name]}" | head -n 1)"
    done
    echo "dry run: ${#stages[@]} budgeted stages, $total s of $budget s; ${#later[@]} after, in what is left:" \
        "$([ $status = 0 ] && echo ok || echo FAILED)"
    exit $status
fi
[ -d .whl ] && export PYTHONPATH=/tmp/linattn-site:$PWD
for stage in "${stages[@]}" "${later[@]}"; do
    name=${stage% *} limit=${stage#* }
    left=$((budget - SECONDS))
    if [ "$left" -lt 30 ]; then echo "$name: skipped, $left s of the budget left" | tee "$out/$name.txt"; continue; fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "== $name ($limit s)"
    # timeout signals the stage's whole process group (both warm processes too)
    timeout "$limit" bash -c "${run[$name]}" > "$out/$name.txt" 2>&1 || { status=$?; echo "$name: exit $status"; }
    tail -n 3 "$out/$name.txt"
done
# the device machine returns at most 8 files: the stages' files go back as one archive, the cache beside it
(cd "$out" && files=$(ls | grep -v -x -e session.tgz -e gpu-cache.tgz) && tar -czf session.tgz $files && rm -r $files)
exit $status   # the last failing stage's status; each stage's file (in OUT/session.tgz) says more
