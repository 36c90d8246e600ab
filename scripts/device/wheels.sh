#!/usr/bin/env bash
# Run here, in the repo root: downloads into .whl (git-ignored) the wheels of the server stack and
# pytest, at the versions installed here, for the GPU lease machine (Python 3.12, x86-64), whose
# image has torch, triton and transformers but not these. Then carry [".whl"] and, there, first
# `source scripts/device/setup.sh`.
set -euo pipefail
names="aiohappyeyeballs aiohttp aiosignal annotated-doc annotated-types anyio attrs certifi click fastapi
frozenlist h11 httpcore httpx idna iniconfig msgspec multidict opentelemetry-api pluggy prometheus_client
propcache pydantic pydantic_core Pygments pytest pytest-timeout pyzmq sniffio starlette typing-inspection
uvicorn partial-json-parser xgrammar pytest-xdist execnet apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py"
pins=()
for n in $names; do
  v=$(python3 -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] || { echo "not installed here: $n (install the README's dev extras first)" >&2; exit 1; }
  pins+=("$n==$v")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls .whl | wc -l
