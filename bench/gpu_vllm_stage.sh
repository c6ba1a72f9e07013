#!/usr/bin/env bash
# vLLM for CUDA on the lent GPU machine (issue 22), in calls of at most 64 MiB each (device tool).
#
# Here, once (downloads ~400 MB, packs ~230 MB; needs ../shared/gpu/smollm2.sh's .gguf, see below):
#   bash bench/gpu_vllm_stage.sh pack [novllm]        -> .gpu/v22/1 .. .gpu/v22/N (git-ignored; novllm: all but
#                                                        vLLM, 3 pieces instead of 6, for runs of the HF engine)
# There, one device call per folder, back to back (the machine forgets /tmp 30 s after a call):
#   bash bench/gpu_vllm_stage.sh stage .gpu/v22/K     (carry [".gpu/v22/K"]), K = 1 .. N
# then, in the call that runs something (carry [".gpu/src"], a `git archive` snapshot of the code):
#   bash bench/gpu_vllm_stage.sh install && bash bench/gpu_vllm_stage.sh env-run python3 -m bench.gpu_vllm ...
# or, to outlast one call's 10 minutes: `start DIR "STEP ..."` queues install and each STEP, run in order by one
# background job (setsid) that logs to /tmp/g22 (DIR: the last piece, staged by the same call; "-": none) and runs
# the code as it was at that `start` (a snapshot in /tmp/g22src); a later `start - "STEP ..."` while it runs adds to
# its queue, run with that snapshot too (after it ended: starts a new job, with a new snapshot). STEP:
#   vllm[:CASES]                  bench.gpu_vllm --cases CASES (default equal,decode)
#   launchers[:ENGINES[:FT]]      bench.gpu_vllm --cases launchers,trl --engines ENGINES (default vllm,hf)
#                                 --finetunes FT (default full; full,lora)
#   rw:CASE[:VERSIONS]            bench.real_workload run --cases CASE --versions VERSIONS (default 60)
#   vl[:CASES[:FLAGS]]            bench.variable_length --cases CASES (default continuous,decode) FLAGS (commas: spaces)
#   vs_trl:WORKLOAD[:VARIANTS[:N[:FLAGS]]] bench.vs_trl run --workload fixed|variable --trl VARIANTS (default
#                                 hf,continuous; none) --versions N (default 15) --distrl_flags FLAGS (commas: spaces;
#                                 `|` separates distrl sides, each its own --distrl_flags; `default`: no flags)
#   real_model[:CASES[:MIN[:FLAGS]]] bench.real_model run --cases CASES (default distrl1,trl) --minutes MIN (default 2)
#                                 FLAGS (commas: spaces; e.g. --clock,launch,--max_steps,60,--stop_gain,0.15)
#   su[:CASES[:STEPS]]            bench.startup run --cases CASES (default hf-cold,hf-warm,vllm-cold,vllm-warm)
#                                 --max_steps STEPS (default 2): start-up phases, cold and warm compile caches
#   pytest:PATH                   pytest -m gpu PATH (e.g. tests/integration/test_hf_kernels_gpu.py)
#   learner[:VARIANTS[:PROMPT:NEW[:MIN[:0.5b]]]] bench.gpu_pipeline --cases mfu on SmolLM2 (the .gguf; 0.5b: the
#                                 random Qwen2.5-0.5B): the learner step of --mfu_variants VARIANTS (default
#                                 defaults,defaults+compile; the first is profiled) on 256 rows of PROMPT (default
#                                 128) + MIN (default NEW / 4) to NEW (default 256) tokens
#   dk[:FLAGS]                    bench.decode_kernels FLAGS (commas: spaces): the decode kernels' launch settings
#   ac[:FLAGS]                    bench.actor_call FLAGS (commas: spaces) on SmolLM2 and GSM8K: where an actor's call goes
#   peer:WORKLOAD[:FLAGS]         bench.vs_peer run --workload variable|arith FLAGS (commas: spaces): verl 0.9.1 (GRPO,
#                                 colocated) against distrl (issue 43); needs the peer's wheels staged first (below)
#   bg:MODULE[:FLAGS]             python3 -m bench.MODULE FLAGS (commas: spaces), niced, no GPU, in the background: the next
#                                 steps start at once (a CPU bench on the machine's 16 cores beside a GPU one)
#   waitbg                        waits for every bg step's end
#   mt[:SEEDS[:FLAGS]]            bench.multiturn run (SmolLM2 with and without --env calculator, issue 44) once per
#                                 seed of SEEDS (commas; default 1,2), the seeds' runs side by side on the GPU
#   mps:on|off                    a private CUDA MPS control daemon (pipe /tmp/mps/pipe): `on` starts it and checks that
#                                 a CUDA process runs under it, after which env-run's processes are its clients; `off`
#                                 quits it (the GPU's compute mode is left as it is)
# e.g. `start .gpu/v22/6 "vl vs_trl:fixed vs_trl:variable rw:defaults:50"`. Each later call (back to back,
# within 30 s) is `poll SECONDS`: waits up to SECONDS for the queue's end, packs /tmp/g22 (and the runs' logs and
# TensorBoard) into $OUT/g22.tgz and prints the logs' last lines. Measured 2026-12-02: staging 108 s of held
# machine (start included), install 8 s, equal 250 s, decode 240 s, variable_length 233 s.
#
# The second peer (issue 43, bench/vs_peer.py): `pack-peer` (here) downloads bench/gpu_peer_wheels.txt (--no-deps)
# and builds antlr4-python3-runtime 4.9.3's wheel (an sdist on the registry) into .gpu/peer/1 .. N (56 MiB pieces);
# there `stage-peer .gpu/peer/K` per piece (carry [".gpu/peer/K"]), then a `start` whose steps include `peer:...`
# installs them once under /tmp/peer_site (`install-peer`), which only verl's process puts ahead of /tmp/site.
#
# What is packed:
# - vllm 0.26.0 (the last release that pins torch 2.11.0, the image's; its kernels link libcudart.so.13 as the
#   image's cu130 torch does), trimmed of what a dense bf16 model on Hopper never loads: FlashAttention 2 (FA3
#   serves sm90; the import is guarded), the MoE, FlashMLA and QuTLASS kernels (imports guarded), the Rust
#   frontend binary, DeepGEMM/FMHA-sm100 sources and the API server's static files: 304 MB wheel -> 73 MB tar.xz
# - the wheels in bench/gpu_vllm_wheels.txt (--no-deps), ~45 MB
# - SmolLM2-135M-Instruct (.gguf, 94 MB, from .gpu/smollm2/ as ../shared/gpu/smollm2.sh makes it) and the
#   Qwen2.5 tokenizer (../shared/data/tokenizers/qwen2.5) for the 0.5B architecture; GSM8K's train.jsonl
#   (../shared/data/gsm8k) beside the last piece, as gsm8k_train.jsonl
set -euo pipefail
mode=${1:?pack, stage DIR, install, env-run CMD, start DIR [STEPS], poll SECONDS, pack-peer, stage-peer DIR or install-peer}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PIECE_MB=56
VLLM=vllm==0.26.0
TRIM=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs
      vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so vllm/_qutlass_C.abi3.so
      vllm/third_party/fmha_sm100 vllm/entrypoints/serve/instrumentator/static
      vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so
      vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 5 17 24 26 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

pack() {
  local stage; stage=$(mktemp -d)
  mkdir -p "$stage/pack/wheels" "$stage/vllm"
  if [ "${1:-}" != novllm ]; then
    python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$stage" "$VLLM"
    (cd "$stage/vllm" && unzip -q "$stage"/vllm-*.whl && rm -rf "${TRIM[@]}" \
       && tar -cf - vllm vllm-*.dist-info | xz -T0 -6 > "$stage/pack/vllm.tar.xz")
  fi
  grep -v '^#' "$ROOT/bench/gpu_vllm_wheels.txt" | grep . > "$stage/req.txt"
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$stage/pack/wheels" -r "$stage/req.txt"
  local gguf="$ROOT/.gpu/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -f "$gguf" ] || { echo "no $gguf: run ../shared/gpu/smollm2.sh .gpu/smollm2 first" >&2; exit 1; }
  cp "$gguf" "$stage/pack/"
  cp -r "$ROOT/../shared/data/tokenizers/qwen2.5" "$stage/pack/qwen2.5"
  tar -cf "$stage/pack.tar" -C "$stage" pack
  rm -rf "$ROOT/.gpu/v22"
  split -b "${PIECE_MB}M" -d "$stage/pack.tar" "$stage/piece."
  local k=1
  for f in "$stage"/piece.*; do mkdir -p "$ROOT/.gpu/v22/$k" && mv "$f" "$ROOT/.gpu/v22/$k/"; k=$((k + 1)); done
  cp "$ROOT/../shared/data/gsm8k/train.jsonl" "$ROOT/.gpu/v22/$((k - 1))/gsm8k_train.jsonl"
  rm -rf "$stage"
  du -sh "$ROOT"/.gpu/v22/*
}

pack_peer() {  # verl's wheels (bench/gpu_peer_wheels.txt) in pieces under .gpu/peer
  local stage; stage=$(mktemp -d)
  mkdir -p "$stage/peer"
  grep -v '^#' "$ROOT/bench/gpu_peer_wheels.txt" | grep . > "$stage/req.txt"
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$stage/peer" -r "$stage/req.txt"
  python3 -m pip wheel -q --no-deps -w "$stage/peer" antlr4-python3-runtime==4.9.3
  tar -cf "$stage/peer.tar" -C "$stage" peer
  rm -rf "$ROOT/.gpu/peer"
  split -b "${PIECE_MB}M" -d "$stage/peer.tar" "$stage/piece."
  local k=1
  for f in "$stage"/piece.*; do mkdir -p "$ROOT/.gpu/peer/$k" && mv "$f" "$ROOT/.gpu/peer/$k/"; k=$((k + 1)); done
  rm -rf "$stage"
  du -sh "$ROOT"/.gpu/peer/*
}

install_peer() {  # join the peer's pieces and install its wheels under /tmp/peer_site (once per machine)
  [ -f /tmp/peer_site/.peer_staged ] && return 0
  cd /tmp/peerstage || return 1
  if ls piece.* > /dev/null 2>&1; then cat piece.* | tar -xf - && rm piece.* || return 1; fi
  mkdir -p /tmp/peer_site || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer_site peer/*.whl || return 1
  touch /tmp/peer_site/.peer_staged
  du -sh /tmp/peer_site
}

install() {  # join the pieces, unpack vllm and install the wheels under /tmp/site (once per machine)
  # each line checked: errexit does not hold inside a function whose status is tested (session's step)
  [ -f /tmp/site/.vllm_staged ] && return 0
  cd /tmp/v22stage || return 1
  if ls piece.* > /dev/null 2>&1; then cat piece.* | tar -xf - && rm piece.* || return 1; fi
  mkdir -p /tmp/site || return 1
  if [ -f pack/vllm.tar.xz ]; then  # not packed by `pack novllm`
    python3 -c "import tarfile; tarfile.open('pack/vllm.tar.xz').extractall('/tmp/site')" || return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site pack/wheels/*.whl || return 1
  # bytecode once, as a user's pip install leaves it: without it each role process compiled ~1,400 modules from
  # source, every time (no .pyc was written back there: 4.5 s of an actor's start-up, BENCHMARKS.md seventeenth round)
  python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1 || true
  touch /tmp/site/.vllm_staged
  du -sh /tmp/site
}

run_step() {  # one STEP (see the header) as the K-th step: logs to /tmp/g22/K-NAME.log
  local k=$1 spec=$2 g=/tmp/g22 pack=/tmp/v22stage/pack kind rest a b c d
  local model="$pack/SmolLM2-135M-Instruct.Q4_1.gguf"
  local vllm=(python3 -m bench.gpu_vllm --model "$model" --tokenizer "$pack/qwen2.5" --out "$g/vllm" --case_timeout_s 600)
  step() { local name=$1 rc=0; shift; echo "$(date +%T) start $name" >> "$g/steps"
           ( "$@" ) > "$g/$name.log" 2>&1 || rc=$?; echo "$(date +%T) end $name: exit $rc" >> "$g/steps"; }
  kind=${spec%%:*}; rest=${spec#*:}; [ "$rest" = "$spec" ] && rest=
  a=${rest%%:*}; b=${rest#*:}; [ "$b" = "$rest" ] && b=
  c=${b#*:}; [ "$c" = "$b" ] && c=; b=${b%%:*}
  d=${c#*:}; [ "$d" = "$c" ] && d=; c=${c%%:*}
  case "$kind" in
    install) step install install ;;
    vllm) step "$k-vllm" bash "$0" env-run "${vllm[@]}" --cases "${a:-equal,decode}" ;;
    launchers) step "$k-launchers" bash "$0" env-run "${vllm[@]}" --cases launchers,trl --engines "${a:-vllm,hf}" \
          --finetunes "${b:-full}" ;;
    rw) step "$k-rw-$a" bash "$0" env-run python3 -m bench.real_workload run --out "$g/rw" --model "$model" \
          --work /tmp/real_workload --cases "$a" --versions "${b:-60}" ;;
    vl) step "$k-vl" bash "$0" env-run python3 -m bench.variable_length --out "$g/vl$k" --cases "${a:-continuous,decode}" \
          ${b//,/ } ;;
    vs_trl) local variants=() parts v; IFS='|' read -r -a parts <<< "$d"
          for v in "${parts[@]:-}"; do [ "$v" = default ] && v=; variants+=("--distrl_flags=${v//,/ }"); done
          step "$k-vs_trl-$a" bash "$0" env-run python3 -m bench.vs_trl run --workload "$a" --trl "${b:-hf,continuous}" \
          --versions "${c:-15}" --model "$model" --tokenizer "$pack/qwen2.5" --dataset /tmp/v22stage/gsm8k_train.jsonl \
          --out "$g/vs_trl$k" --work "/tmp/vs_trl$k" --hard_s 400 "${variants[@]}" ;;
    real_model) step "$k-real_model" bash "$0" env-run python3 -m bench.real_model run --model "$model" \
          --out "$g/rm$k" --work "/tmp/real_model$k" --cases "${a:-distrl1,trl}" --minutes "${b:-2}" --hard_s 400 \
          ${c//,/ } ;;
    su) step "$k-startup" bash "$0" env-run python3 -m bench.startup run --model "$model" --out "$g/su$k" \
          --work "/tmp/startup$k" --cases "${a:-hf-cold,hf-warm,vllm-cold,vllm-warm}" --max_steps "${b:-2}" ;;
    pytest) step "$k-pytest" bash "$0" env-run python3 -m pytest -q -s -m gpu -p no:cacheprovider "$a" ;;
    learner) local variants=${a:-defaults,defaults+compile} min=${d%%:*} arch=${d#*:} src=(--model "$model")
          [ "$arch" = "$d" ] && arch=; [ "$arch" = 0.5b ] && src=(--arch qwen2.5-0.5b --tokenizer "$pack/qwen2.5")
          step "$k-learner" bash "$0" env-run python3 -m bench.gpu_pipeline --cases mfu "${src[@]}" \
          --mfu_variants "$variants" --profile_variant "${variants%%,*}" --prompt_len "${b:-128}" \
          --max_new_tokens "${c:-256}" ${min:+--min_new_tokens "$min"} --out "$g/learner$k" --work "/tmp/learner$k" ;;
    dk) step "$k-dk" bash "$0" env-run python3 -m bench.decode_kernels --out "$g/dk$k" ${a//,/ } ;;
    peer) step "$k-install-peer" bash "$0" install-peer
          step "$k-peer-$a" bash "$0" env-run python3 -m bench.vs_peer run --workload "$a" --model "$model" \
          --dataset /tmp/v22stage/gsm8k_train.jsonl --peer_site /tmp/peer_site --out "$g/peer$k" \
          --work "/tmp/vs_peer$k" ${b//,/ } ;;
    mps) step "$k-mps-$a" bash "$0" mps "$a" ;;
    bg) step "$k-bg-$a" env CUDA_VISIBLE_DEVICES= nice bash "$0" env-run python3 -m "bench.$a" ${b//,/ } & ;;
    waitbg) wait ;;
    mt) local seeds=() sd; IFS=',' read -r -a seeds <<< "${a:-1,2}"
          mt_seed() { bash "$0" env-run python3 -m bench.multiturn run --model "$model" --seed "$1" \
                        --out "$g/mt$k-s$1" --work "/tmp/multiturn$k-s$1" ${b//,/ }; }
          mt_all() { local pids=() s rc=0; for s in "${seeds[@]}"; do mt_seed "$s" > "$g/mt$k-s$s.out" 2>&1 & pids+=($!); done
                     for s in "${pids[@]}"; do wait "$s" || rc=$?; done; return "$rc"; }
          step "$k-mt" mt_all ;;
    ac) step "$k-ac" bash "$0" env-run python3 -m bench.actor_call --model "$model" \
          --dataset /tmp/v22stage/gsm8k_train.jsonl --out "$g/ac$k" ${a//,/ } ;;
    *) echo "$(date +%T) unknown step $spec" >> "$g/steps" ;;
  esac
}

session() {  # the background job of `start`: the queue's steps in order, then DONE (a later `start` adds more)
  local g=/tmp/g22 k spec
  while true; do
    spec=$(flock "$g/lock" bash -c 'head -n 1 /tmp/g22/queue; sed -i 1d /tmp/g22/queue')
    if [ -z "$spec" ]; then  # empty: end, unless a `start` queued more meanwhile
      [ "$(flock "$g/lock" bash -c '[ -s /tmp/g22/queue ] && echo more || { rm -f /tmp/g22/RUNNING; touch /tmp/g22/DONE; }')" ] \
        || return 0
      continue
    fi
    k=$(( $(cat "$g/count" 2>/dev/null || echo 0) + 1 )); echo "$k" > "$g/count"
    run_step "$k" "$spec"
  done
}

case "$mode" in
  start) mkdir -p /tmp/g22 && touch /tmp/g22/steps /tmp/g22/queue
    if [ "${2:-}" != - ]; then mkdir -p /tmp/v22stage && cp "$2"/* /tmp/v22stage/; fi
    steps="install ${3:-vllm launchers}"  # install: once per machine, a no-op after
    spawn=$(flock /tmp/g22/lock bash -c 'printf "%s\n" $0 >> /tmp/g22/queue; rm -f /tmp/g22/DONE
      [ -f /tmp/g22/RUNNING ] && echo no || { touch /tmp/g22/RUNNING; echo yes; }' "$steps")
    if [ "$spawn" = yes ]; then  # the job runs from a snapshot of the tree: each later device call copies the
      # working tree again, and a process that starts meanwhile once imported a half-copied package (2026-12-03)
      rm -rf /tmp/g22src && mkdir -p /tmp/g22src
      if ! tar -C "$ROOT" --exclude=./.gpu --exclude=./.venv --exclude=./.git --exclude=./runs -cf - . \
          | tar -C /tmp/g22src -xf -; then  # no job: the next start must spawn one
        rm -f /tmp/g22/RUNNING; echo "start: the snapshot of $ROOT failed; nothing runs" >&2; exit 1
      fi
      setsid nohup bash /tmp/g22src/bench/gpu_vllm_stage.sh session >> /tmp/g22/session.log 2>&1 < /dev/null &
    fi
    sleep 2; cat /tmp/g22/steps; echo "queued: $(tr '\n' ' ' < /tmp/g22/queue)" ;;
  session) cd "$ROOT" && session ;;
  poll) for _ in $(seq "${2:-60}"); do [ -f /tmp/g22/DONE ] && break; sleep 1; done
    tar czf "$OUT/g22.tgz" -C /tmp g22 $(cd /tmp && find gpu_vllm \( -name "*.log" -o -name "*.out" \) -size -4M 2>/dev/null) \
      $(cd /tmp && ls -d real_workload/*/tb real_workload/*/logs real_model*/*/logs real_model*/*/tb multiturn*/*/logs multiturn*/*/eval.jsonl vs_trl*/*/logs vs_peer*/*/*.log \
        vs_trl*/*/tb startup*/*/logs startup*/*/summary.json 2>/dev/null) || true
    cat /tmp/g22/steps; for f in /tmp/g22/*.log; do echo "== $f"; tail -n 6 "$f"; done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  pack) pack "${2:-}" ;;
  pack-peer) pack_peer ;;
  stage-peer) mkdir -p /tmp/peerstage && cp "$2"/* /tmp/peerstage/ && ls /tmp/peerstage ;;
  install-peer) t0=$(date +%s); install_peer; echo "install-peer: $(( $(date +%s) - t0 )) s" ;;
  stage) mkdir -p /tmp/v22stage && cp "$2"/* /tmp/v22stage/ && ls /tmp/v22stage ;;
  install) t0=$(date +%s); install; echo "install: $(( $(date +%s) - t0 )) s" ;;
  mps) export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
    if [ "${2:-}" = on ]; then
      mkdir -p /tmp/mps/pipe /tmp/mps/log && which nvidia-cuda-mps-control && timeout 30 nvidia-cuda-mps-control -d \
        && timeout 90 python3 -c 'import torch; x = torch.ones(1 << 20, device="cuda"); print("mps client:", x.sum().item())' \
        && touch /tmp/mps/ON; rc=$?; cat /tmp/mps/log/*.log 2>/dev/null | tail -n 20; exit "$rc"
    fi
    rm -f /tmp/mps/ON; echo quit | timeout 30 nvidia-cuda-mps-control; cat /tmp/mps/log/*.log 2>/dev/null | tail -n 5 ;;
  env-run) shift
    if [ -f /tmp/mps/ON ]; then export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log; fi
    export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
      TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 DISTRL_GGUF_CACHE=/tmp/gguf \
      VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
    "$@" ;;
  *) echo "unknown mode $mode: pack, stage DIR, install, env-run CMD, start DIR [STEPS] or poll SECONDS" >&2; exit 2 ;;
esac
