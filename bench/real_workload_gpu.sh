#!/usr/bin/env bash
# bench/real_workload.py on the lent GPU machine (one H200). Staging as bench/real_model_gpu.sh says
# (`bash bench/real_model_gpu.sh stage DIR`, one call per folder of at most ~60 MiB: the wheels, SmolLM2's
# two halves), then, in a call carrying .gpu/src (a snapshot of the code: `git archive` of a commit
# whose `distrl train` works, plus the bench files):
#   bash bench/real_workload_gpu.sh "<case>[:<versions>] ..." "<more bench.real_workload run flags>"
# Each case runs as its own `bench.real_workload run` (one after another on the GPU); after each one the
# cases' JSON, logs and TensorBoard go to $OUT/rw.tgz, so a call stopped at its limit still returns them.
set -uo pipefail
cd /tmp/stage || exit 1
[ -f SmolLM2-135M-Instruct.Q4_1.gguf ] || { cat part00 part01 > SmolLM2-135M-Instruct.Q4_1.gguf && rm part00 part01; }
for f in *.part00; do [ -e "$f" ] && cat "${f%.part00}".part* > "${f%.part00}" && rm "${f%.part00}".part*; done
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl
cd - >/dev/null && cd .gpu/src || exit 1
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 DISTRL_GGUF_CACHE=/tmp/gguf
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
for spec in $1; do
  case=${spec%%:*}; versions=${spec#*:}; [ "$versions" = "$spec" ] && versions=60
  # shellcheck disable=SC2086
  python3 -m bench.real_workload run --model /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/rw_out \
    --work /tmp/real_workload --cases "$case" --versions "$versions" ${2:-} > "/tmp/rw_out_$case.txt" 2>&1
  grep -E "^$case: " "/tmp/rw_out_$case.txt" || tail -5 "/tmp/rw_out_$case.txt"
  tar czf "$OUT/rw.tgz" -C /tmp rw_out $(cd /tmp && ls rw_out_*.txt; ls -d real_workload/*/tb real_workload/*/logs 2>/dev/null)
done
python3 -m bench.real_workload report /tmp/rw_out && cp bench/results/real_workload.json "$OUT/"
