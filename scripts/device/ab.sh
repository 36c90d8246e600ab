#!/usr/bin/env bash
# A/B of code variants in one call on the GPU lease machine (after `source scripts/device/setup.sh`),
# so that every variant runs on the same card, in turns (clock and thermal drift fall on all alike).
#
#   bash scripts/device/ab.sh ROUNDS 'COMMAND' VARIANT_DIR [VARIANT_DIR ...]
#
# A variant is a folder that mirrors the repository's paths, holding only the files it changes, e.g.
# .dev/before/kernels/triton/attention.py (git-ignored .dev travels with carry [".dev"]). Each round
# copies each variant's files over the checkout as it was (not over the variant before), then runs COMMAND; its whole output goes to
# $OUT/<variant>-<round>.log (OUT: the lease's output folder; a temporary one elsewhere) and its last
# TAIL lines (default 3) are printed under "== <variant> <round> rc <status>". The files variants touched are
# put back as they were before the first round, and files only variants had are removed, whatever happens.
#   bash scripts/device/ab.sh 2 'python -m benchmarks.roofline --fp8 block --kv-cache-dtype fp8
#     --no-prefill --async-scheduling --models llama3-8b' .dev/before .dev/new
set -uo pipefail
if [ $# -lt 3 ]; then
  echo "usage: bash scripts/device/ab.sh ROUNDS 'COMMAND' VARIANT_DIR [VARIANT_DIR ...]" >&2
  exit 2
fi
rounds=$1 cmd=$2
shift 2
out=${OUT:-$(mktemp -d)}
saved=$(mktemp -d)
for v in "$@"; do
  [ -d "$v" ] || { echo "no variant folder: $v" >&2; exit 2; }
  (cd "$v" && find . -type f) | while read -r f; do
    if [ -e "$saved/$f" ] || grep -qxF "$f" "$saved.new" 2>/dev/null; then continue; fi
    if [ -e "$f" ]; then mkdir -p "$saved/$(dirname "$f")" && cp -p "$f" "$saved/$f"; else echo "$f" >> "$saved.new"; fi
  done
done
restore() {  # the checkout's files as they were; files only variants had, removed
  (cd "$saved" && find . -type f -exec cp -p {} "$OLDPWD/{}" \;)
  if [ -e "$saved.new" ]; then xargs -d '\n' rm -f < "$saved.new"; fi
}
trap restore EXIT
for r in $(seq 1 "$rounds"); do
  for v in "$@"; do
    restore  # each variant over the checkout as it was, not over the variant before it
    cp -r "$v"/. .
    name=$(basename "$v")
    bash -c "$cmd" > "$out/$name-$r.log" 2>&1
    echo "== $name $r rc $?"
    tail -n "${TAIL:-3}" "$out/$name-$r.log"
  done
done
