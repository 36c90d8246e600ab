#!/usr/bin/env bash
# The GPU suites on the lease machine (after `source scripts/device/setup.sh`), in groups that fit calls:
#
#   bash scripts/device/gpu_tests.sh GROUP[:SECONDS] ... [-- PYTEST_ARGS...]
#
# kernels: tests/kernels, side by side (pytest-xdist, a worker a core but two and at most one each 10 GiB of the GPU:
#   14 on the H200 machine, 7 on the H100's): its 456 one-GPU cases in about 2 minutes there.
# pd: tests/e2e/test_disagg_gpu.py and tests/connectors, 3 side by side (each server sizes its KV cache
#   with --kv-cache-memory-bytes).
# engine: the rest (tests/engine, tests/server's GPU file, tests/benchmarks), one at a time (tests/server's others
#   import openai, which the device wheels leave out: they run on CPU only): these engines size their
#   KV cache from the GPU's free memory, so two at once would starve each other. test_fp8_gpu.py alone ran
#   past 290 s on an H200: split the group with -- -k where a call's time is short.
# Each group runs under its SECONDS (default 300) and writes $OUT/gpu-GROUP.log (OUT: the lease's output
# folder; a temporary one elsewhere); its summary line is printed. The exit status is the first failing
# group's pytest status (5: nothing collected counts as a failure).
#   bash scripts/device/gpu_tests.sh kernels:200 pd:280
#   bash scripts/device/gpu_tests.sh engine:540 -- -k "fp8 and not tensor"
set -uo pipefail
out=${OUT:-$(mktemp -d)}
groups=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do groups+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the "--"
[ ${#groups[@]} -gt 0 ] || { echo "usage: bash scripts/device/gpu_tests.sh GROUP[:SECONDS] ... [-- PYTEST_ARGS...]" >&2; exit 2; }
workers=$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))
# and a worker for each 10 GiB of the GPU: 14 side by side ran out of memory on an H100's 80 GB (a MoE case)
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ -n "$mib" ]; then
  cap=$(( mib / 10240 > 1 ? mib / 10240 : 1 ))
  [ $cap -lt $workers ] && workers=$cap
fi
status=0
for g in "${groups[@]}"; do
  name=${g%%:*} limit=300
  [ "$name" != "$g" ] && limit=${g#*:}
  case $name in
    kernels) paths=(tests/kernels) par=(-n "$workers") ;;
    pd) paths=(tests/e2e/test_disagg_gpu.py tests/connectors) par=(-n 3) ;;
    engine) paths=(tests/engine tests/server/test_compile_ahead_gpu.py tests/benchmarks) par=() ;;
    *) echo "unknown group $name (kernels, pd, engine)" >&2; exit 2 ;;
  esac
  log=$out/gpu-$name.log
  timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -q -rfE "${par[@]}" "${paths[@]}" "$@" > "$log" 2>&1
  rc=$?
  echo "== $name rc $rc: $(grep -E ' in [0-9.]+s' "$log" | tail -1)"
  grep -E "^(FAILED|ERROR) " "$log" | head -20
  [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
done
exit $status
