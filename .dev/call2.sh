source scripts/device/setup.sh || exit 1
AB="python -m benchmarks.ab_decode --models llama3-8b --fp8 block --kv-cache-dtype fp8"
timeout 330 $AB --batch 1 --rounds 3 --variants default plans=.dev/qkvring.json no-fp8-tma-gemm plans=.dev/qkvring.json+no-fp8-tma-gemm --out $OUT/ab1.json 2>&1 | grep -v "leaked\|nanobind\|compiled after" > $OUT/ab1.log; tail -7 $OUT/ab1.log
timeout 240 $AB --batch 16 --rounds 2 --variants default fp8-tma-ring-batch+plans=.dev/ring16.json fp8-tma-ring-batch+plans=.dev/ring16.json+plans=.dev/qkvring.json --out $OUT/ab16.json 2>&1 | grep -v "leaked\|nanobind\|compiled after" > $OUT/ab16.log; tail -6 $OUT/ab16.log
