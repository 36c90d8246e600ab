# Source on the GPU lease machine from the repo root (after scripts/device/wheels.sh here, with
# carry [".whl"]): installs the wheels into /tmp/site and maps the tandem.* namespace onto this
# checkout's folders by links (pyproject's package-dir mapping, without an install).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
mkdir -p /tmp/site/tandem
for p in server engine kernels connectors router; do ln -sfn "$PWD/$p" "/tmp/site/tandem/$p"; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
