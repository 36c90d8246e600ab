#!/usr/bin/env bash
# Issue 21's decode targets on the GPU lease machine (after `source scripts/device/setup.sh`): Llama-3-8B at
# batch 1 and 64, Qwen3-30B-A3B at batch 1 (block-scaled FP8 weights, fp8 KV cache, 1k context), one
# benchmarks.ab_decode process a line, the ceiling (the HBM floor at the copy rate) measured in the same process.
#
#   bash scripts/device/targets.sh [VARIANT ...]
#
# With variants (ab_decode's --variants names, e.g. fp8-tma-ring-moe-fold or plans=F), each target runs default
# then each variant, every one in its own process, twice in turns (A B A B): machines differ by up to 4% on
# the same code, so a variant is compared only with the defaults beside it. Prints ab_decode's row for each
# process (model, variant, ms, floor ms, share of the floor, share of greedy tokens equal to the first
# variant's); the whole output of each goes to $OUT/targets.log (OUT: the lease's output folder).
set -uo pipefail
out=${OUT:-$(mktemp -d)}
variants=(default "$@")
turns=$(( $# > 0 ? 2 : 1 ))
for target in llama3-8b:1 llama3-8b:64 qwen3-30b-a3b:1; do
  model=${target%%:*} batch=${target#*:}
  for _ in $(seq $turns); do
    for v in "${variants[@]}"; do
      log=$(mktemp)
      timeout 120 python3 -m benchmarks.ab_decode --fp8 block --kv-cache-dtype fp8 --rounds 3 --batch "$batch" \
        --models "$model" --variants "$v" > "$log" 2>&1
      rc=$?
      cat "$log" >> "$out/targets.log"
      row=$(grep -E "^$model " "$log" | tail -1)
      echo "b=$batch ${row:-$model $v: no result (rc $rc; see targets.log)}"
    done
  done
done
