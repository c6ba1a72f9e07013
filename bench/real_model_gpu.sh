#!/usr/bin/env bash
# bench/real_model.py on the lent GPU machine (one H200), in calls of at most 64 MiB each (device tool):
#   ../shared/gpu/wheels.sh .whl; ../shared/gpu/smollm2.sh .gpu/smollm2   (here, once)
#   bash bench/real_model_gpu.sh stage DIR     one call per folder, carrying it: .whl/1 .. .whl/5,
#                                              .gpu/smollm2/1, .gpu/smollm2/2 (copied into /tmp/stage)
#   bash bench/real_model_gpu.sh run "<bench.real_model run arguments>"
# `run` joins the model's halves and split wheels, installs the wheels under /tmp/site (once), runs the
# cases and copies their logs and JSON to $OUT; the table comes last.
set -euo pipefail
mode=$1; shift
if [ "$mode" = stage ]; then
  mkdir -p /tmp/stage && cp -r "$1"/* /tmp/stage/ && ls /tmp/stage | wc -l && exit 0
fi
cd /tmp/stage
[ -f SmolLM2-135M-Instruct.Q4_1.gguf ] || { cat part00 part01 > SmolLM2-135M-Instruct.Q4_1.gguf && rm part00 part01; }
for f in *.part00; do [ -e "$f" ] && cat "${f%.part00}".part* > "${f%.part00}" && rm "${f%.part00}".part*; done
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl
cd - >/dev/null
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 DISTRL_GGUF_CACHE=/tmp/gguf
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
# shellcheck disable=SC2086
python3 -m bench.real_model run --model /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/rm_out $1 \
  > /tmp/rm_out.txt 2>&1 || echo "bench.real_model exited $?"
mkdir -p "$OUT/cases"
cp /tmp/rm_out/*.json "$OUT/cases/" 2>/dev/null || true
tar czf "$OUT/logs.tgz" -C /tmp rm_out $(cd /tmp && ls -d real_model/*/logs real_model/*/tb 2>/dev/null) 2>/dev/null || true
cat /tmp/rm_out.txt | grep -v -E "Loading weights|it/s\]|UserWarning|warnings.warn" | tail -40
