#!/usr/bin/env bash
# One GPU-machine call of the issue-7 benchmarks (run through the device tool, in the repository root):
#   carry .whl/gpu (wheels: ../shared/gpu/wheels.sh, plus cut-cross-entropy) and .gpu/qwen2.5 (the tokenizer);
#   bash bench/gpu_session.sh "<gpu_pipeline.py arguments>"
# It installs the wheels under /tmp/site, runs bench/gpu_pipeline.py with the given arguments, writes to
# $OUT, and prints the table last.
set -euo pipefail
if [ ! -d /tmp/site/zmq ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/*.whl
fi
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
# shellcheck disable=SC2086
python3 -m bench.gpu_pipeline --tokenizer .gpu/qwen2.5 --out "$OUT" --work /tmp/gpp $1 2>&1 | tee "$OUT/log.txt" | \
  grep -v -E "Loading weights|Writing model shards|it/s\]|^W1|UserWarning|warnings.warn" | tail -60
