# The two-GPU goodput experiment (issue 25), time-boxed so that it fits device calls of at most
# 10 minutes: jobs run in the order given, each a `benchmarks.goodput` run of one topology on
# GPUs 0,1 with dummy weights of one model shape; a job is skipped when less than MIN_JOB_S
# seconds are left of SECONDS, and cut (its finished rates kept) when the time runs out. Every
# job's folder (goodput.json, per-rate requests, server logs) goes into $OUT/goodput-TAG.tgz.
#
#   source scripts/device/setup.sh
#   bash scripts/device/goodput_2gpu.sh TAG SECONDS MODEL/TOPOLOGY/RATES ...
#   e.g. bash scripts/device/goodput_2gpu.sh a 540 llama3-8b/colloc:2/8,16,24,32,40 llama3-8b/pd:1p1d:write:ipc/8,16,24
#
# Workload (env, defaults as issue 25): OSL=200 output tokens, ISL=2000 input tokens, DURATION=10
# seconds of Poisson arrivals per rate (at least NUM=60 requests), SLO TTFT 1 s and TPOT 50 ms
# (the strict, every-gap attainment is recorded beside it), target 90%, ascending rates stopped at
# the first miss, then BISECT=1 rate between the last pass and the first miss.
set -u
tag=$1 budget=$2
shift 2
start=$SECONDS
out=${OUT:-/tmp/out} work=/tmp/goodput
min_job=${MIN_JOB_S:-120}
mkdir -p "$work" "$out" /tmp/models
for job in "$@"; do
  IFS=/ read -r model topo rates <<<"$job"
  left=$((budget - (SECONDS - start)))
  if ((left < min_job)); then
    echo "goodput_2gpu: skipped $job ($left s left)"
    continue
  fi
  m=/tmp/models/$model
  args=(--server-args "--model $m --load-format dummy ${SERVER_ARGS:-}" --tokenizer "$m")
  if [ "$model" = default ]; then  # the embedded model (a dry run on CPU: GPUS=none)
    args=(--server-args "${SERVER_ARGS:-}")
  elif [ ! -f "$m/config.json" ]; then
    python -m benchmarks.dummy_model --shape "$model" --out "$m" || exit
  fi
  dir=$work/$model-${ISL:-2000}-${OSL:-200}/${topo//:/_}
  mkdir -p "$dir"
  echo "goodput_2gpu: $job, $left s left, into $dir"
  timeout --signal=TERM $((left - 10)) python -m benchmarks.goodput --topology "$topo" --gpus "${GPUS:-0,1}" \
    "${args[@]}" --rates "$rates" --num-prompts "${NUM:-60}" --duration "${DURATION:-10}" \
    --random-input-len "${ISL:-2000}" --random-output-len "${OSL:-200}" --slo-ttft-ms 1000 --slo-tpot-ms 50 \
    --stop-at-miss --bisect-steps "${BISECT:-1}" --warmup-prompts 8 --no-plot --out-dir "$dir" >"$dir/harness.log" 2>&1
  rc=$?
  tr '\r' '\n' <"$dir/harness.log" | grep -E "attainment [0-9.]+%|goodput|Error|error" | awk '!seen[$0]++' | tail -n 12
  echo "goodput_2gpu: $job ended (rc $rc) at $((SECONDS - start)) s"
done
tar czf "$out/goodput-$tag.tgz" -C "$work" .
