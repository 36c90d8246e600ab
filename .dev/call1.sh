source scripts/device/setup.sh || exit 1
cd $PWD
python -m pytest -q -m gpu tests/kernels/test_fp8_tma.py -k ring -p no:cacheprovider 2>&1 | grep -v "leaked\|nanobind" | tail -8
timeout 260 python -m benchmarks.fp8_gemm --ring --rows 1 16 64 --shapes 6144,4096 4096,4096 28672,4096 4096,14336 --out $OUT/ring.json 2>&1 | grep -v "leaked\|nanobind" > $OUT/ring.log; tail -14 $OUT/ring.log
timeout 240 python -m benchmarks.ab_decode --models llama3-8b --fp8 block --kv-cache-dtype fp8 --batch 64 --rounds 3 --variants default fp8-tma-ring-batch --out $OUT/ab64.json 2>&1 | grep -v "leaked\|nanobind" > $OUT/ab64.log; tail -6 $OUT/ab64.log
