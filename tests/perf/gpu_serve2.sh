#!/usr/bin/env bash
# One device call for issue 38 (about 7-9 minutes on an H100): on one synthetic GGUF
# (Llama-3.1-8B shape, Q4_K_M, SmolLM2's tokenizer, `--text-head`: the output head never picks a
# token that is not valid UTF-8, so llama-server's output parser accepts every reply), in order:
#   tests    GPU tests (TESTS: serve's start-up warm-up, no capture or triton compile after it;
#            add tests/engine/test_graph_ladder.py for the ladder, ~50 s), while the file is written
#   llama    llama-server, a fair config for many users (LLAMA_ARGS, default below),
#            tests/perf/bench_serve.py at CONC streams (token-id prompts 512-2,048 with shared
#            prefixes, 256 tokens each: ignore_eos, and min_tokens for ours; streaming
#            /v1/completions)
#   ours     `localllm serve -np 64` as shipped (`--warmup full`: every graph and kernel made
#            before it listens; since 2026-12-07 the batch GEMM and `-b 2048` are its GPU
#            defaults: ours-bgemm-b2k is ours), started with an empty triton cache (TRITON_CACHE_DIR: a first
#            start on a machine), the same client, prompts and lengths
#   restart  ours started again on the triton cache `ours` left (a restart): start-up only
# Each server's time from launch to /health 200 (and ours' warm-up line) goes in the summary.
# Optional steps (STEPS): llama-old (the config of the 09:06 run, `-np 64 -c 163840 -fa on -ngl
# 99`, whose 64 streams collapsed: ~3 minutes), ours-bgemm (ours with triton_linear.BATCH_GEMM on:
# the batch GEMM over packed blocks for 9-64 rows in place of a bf16 weight copy; after its GPU
# test), ours-bgemm-b2k (the same with -b 2048: fewer steps pay a prompt chunk's weight copy),
# ours-shadow (BATCH_GEMM and HALF_SHADOW: a bf16 copy of the weights kept from load), depth
# (tg128 at depth 8K and 32K, `localllm bench -d` and `llama-bench -d`), kernels (tests/perf/decode_kernels.py at KDEPTHS), batched
# (llama-batched-bench -npp 1024 -ntg 128 -npl 1,16,64), ours-b2k (ours with `-b 2048`),
# ours-cold-none (ours with `--warmup none`: the first-request stall it avoids), steps
# (tests/perf/serve_steps.py in process at STEPS_CONC streams, default 16,64: time by step kind),
# replay (tests/perf/graph_replay_diff.py: graph replay against eager decode per split).
# Then one table ($OUT/summary.md; serve_report.py gives no ratio at a level where either server
# failed a request). $OUT: summary.md, serve_*.json, startup_*.txt, the logs. Results:
# tests/perf/results/server.md.
#
# llama-server's default config: `--cache-ram 0`. llama.cpp 3f545bec keeps a host-RAM prompt
# cache (`--cache-ram`, default 8192 MiB, common/common.h:616) and, by default, saves every idle
# slot into it each time a task starts (`--cache-idle-slots`, common/common.h:613;
# tools/server/server-context.cpp:2309-2323): `prompt_save` copies the slot's whole KV to the host
# (`llama_state_seq_get_data_ext`, server-context.cpp:253-277) on the server's one thread, while
# no batch runs. The slot a new task takes by LRU is saved and a cached prompt loaded too
# (server-context.cpp:1533-1549). At 64 slots of ~2,300 tokens (128 KiB a token for this shape:
# 32 layers x 8 KV heads x 128 x K,V x 2 bytes) that is ~18 GiB, more than the 8 GiB cache:
# `server_prompt_cache::alloc` evicts the oldest (server-task.cpp:1711-1760) and the next task
# saves them again, so each of the 64 arrivals copies gigabytes while the GPU waits (13 % busy,
# first tokens after 121 s in the 09:06 run). `--cache-ram 0` turns the cache and the idle-slot
# saves off (server-context.cpp:1258-1269, 1327-1330); a task still takes the idle slot whose
# prompt shares the most with its own (`--slot-prompt-similarity` 0.1, common/common.h:678;
# server-context.cpp:1457-1490) and reuses that prefix.
# The rest is what llama.cpp's own server benchmark runs (tools/server/bench/README.md:30-43,
# 100-118: --parallel N, --cont-batching, --batch-size 2048, a context per slot) at the defaults
# the lead's llama-batched-bench used (-b 2048 -ub 512, no unified KV: per-slot streams, which
# tools/server/server.cpp:152-157 turns into a unified KV only for -np auto).
#
# Prepare once on the development machine: bash tests/perf/serve2_prepare.sh (makes .serve2/,
# ~31 MiB: llama.cpp 3f545bec's llama-server, llama-bench and llama-batched-bench built for sm_90,
# the wheels, the tokenizer). Then the device call, from the repo root:
#   bash tests/perf/gpu_serve2.sh        carry [".serve2"]          (timeout_s 600)
# Knobs: STEPS ("tests llama ours restart"), TESTS (the tests step's files), CONC (1,16,64), GEN
# (256), NP (64), LLAMA_ARGS (llama-server's flags after -m: "-np NP -c NP*2560 -fa on -ngl 99 -b
# 2048 -ub 512 --cache-ram 0"), WARMUP (ours' --warmup: full), LEVEL_S (a level starts no
# measured request after this many seconds: 30),
# BUDGET_S (a step that would start after this many seconds is skipped: 470), END_S (every step's
# timeout ends by then: 575, inside the device's 600 s), DEPTHS (8192,32768), KDEPTHS (the
# kernel breakdown's depths: 512,8192), BENCH_ARGS (more bench_serve.py flags). A dry run on a
# CPU (a CPU build of llama.cpp's bin/ in LLB):
#   NO_INSTALL=1 DEVICE=cpu SHAPE=tiny NP=4 CONC=1,2 GEN=16 DEPTHS=256 LLB=... BENCH_ARGS="--min-prompt
#   256 --max-prompt 1024 --system 128 --docs 128,256,512" bash tests/perf/gpu_serve2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-tests llama ours restart}
CONC=${CONC:-1,16,64}
GEN=${GEN:-256}
NP=${NP:-64}
SHAPE=${SHAPE:-llama3-8b}
LEVEL_S=${LEVEL_S:-30}
BUDGET_S=${BUDGET_S:-470}
DEPTHS=${DEPTHS:-8192,32768}
KDEPTHS=${KDEPTHS:-512,8192}
DEVICE=${DEVICE:-cuda}
WARMUP=${WARMUP:-full}
TESTS=${TESTS:-tests/app/test_serve_warmup_gpu.py}
LLAMA_ARGS=${LLAMA_ARGS:--np $NP -c $((NP * 2560)) -fa on -ngl 99 -b 2048 -ub 512 --cache-ram 0}
LLAMA_OLD_ARGS="-np $NP -c $((NP * 2560)) -fa on -ngl 99"  # the 09:06 run's
LLB=${LLB:-/tmp/llb}  # llama.cpp's bin/ (its run path is /tmp/llb/bin: unpacked there)
if [ -z "${NO_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .serve2/whl/gguf-*.whl .serve2/whl/llguidance-*.whl
  # the server's stack behind the image's own packages (a .pth appends; else PYTHONPATH's end)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 \
    $(ls .serve2/whl/*.whl | grep -v -e /gguf- -e /llguidance-) 2>&1 | tail -2
  python3 -c "import site, pathlib; d = pathlib.Path(site.getsitepackages()[0]); \
    (d / 'zz_localllm_serve.pth').write_text('/tmp/site2\n')" 2>/dev/null || SITE2=:/tmp/site2
  [ -x $LLB/bin/llama-server ] || { mkdir -p $LLB && cat .serve2/llb.part.* | xz -d | tar x -C $LLB; }
fi
mkdir -p /tmp/site && ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD${SITE2:-}
export LD_LIBRARY_PATH=$LLB/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, triton, fastapi; print('torch', torch.__version__, 'triton', \
    triton.__version__, 'fastapi', fastapi.__version__)"
  nproc | sed 's/^/cpus /'; date -u; } | tee "$OUT/machine.txt"
TOK=.serve2/smollm2-tok.gguf
[ -f "$TOK" ] || TOK=.refbuild/smollm2-tok.gguf
case $SHAPE in llama3-8b) CTX=131072 ;; *) CTX=2048 ;; esac
MODEL=/tmp/serve2-$SHAPE.gguf
if [ ! -f "$MODEL.done" ]; then  # a warm machine reuses the file
  (python3 tests/perf/make_synthetic.py --shape "$SHAPE" --quant Q4_K_M -o "$MODEL" --text-head \
    --tokenizer-from "$TOK" >/tmp/make_serve2.log 2>&1 && touch "$MODEL.done") &
  GEN_PID=$!
fi
model_ready() { [ -z "${GEN_PID:-}" ] || wait $GEN_PID; GEN_PID=; [ -f "$MODEL.done" ] || { tail -3 /tmp/make_serve2.log; return 1; }; }
healthy() {  # URL PID SECONDS: until URL/health answers 200 (false if PID exits or time runs out)
  python3 - "$@" <<'EOF'
import sys, time, urllib.request, os
url, pid, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.time() + limit
while time.time() < end:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    try:
        if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
            sys.exit(0)
    except Exception:
        pass
    time.sleep(1)
sys.exit(1)
EOF
}
bench() {  # LABEL URL: bench_serve at every level into $OUT/serve_LABEL.json, the GPU sampled
  local smi=
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits \
      -lms 250 >"$OUT/smi_$1.csv" 2>/dev/null &
    smi=$!
  fi
  timeout "$(cap 300)" python3 tests/perf/bench_serve.py --url "$2" --label "$1" --concurrency "$CONC" \
    --gen "$GEN" --max-seconds "$LEVEL_S" --json "$OUT/serve_$1.json" ${BENCH_ARGS:-} 2>&1 \
    | tee -a "$OUT/serve.log"
  [ -z "$smi" ] || kill "$smi" 2>/dev/null
}
cap() { local t=$((${END_S:-575} - SECONDS)); [ "$t" -lt "$1" ] || t=$1; [ "$t" -gt 5 ] || t=5; echo $t; }
stop() { kill "$1" 2>/dev/null; for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done; kill -9 "$1" 2>/dev/null; }
serve_ours() {  # LABEL TRITON_CACHE [serve flags]: localllm serve in the background ($pid)
  local label=$1 cache=$2; shift 2
  local launch=(-m localllm.app)  # SW: switches set for this server (tests/perf/with_switches.py)
  [ -z "${SW:-}" ] || launch=(tests/perf/with_switches.py $SW -- -m localllm.app)
  TRITON_CACHE_DIR=$cache python3 "${launch[@]}" serve -m "$MODEL" --device "$DEVICE" \
    -np "$NP" -c "$CTX" --port 8181 --warmup "$WARMUP" "$@" >"$OUT/server_$label.log" 2>&1 &
  pid=$!
}
ours() {  # LABEL [serve flags]: localllm serve (an empty triton cache: a first start), benched
  local label=$1; shift
  local t0=$SECONDS
  rm -rf "/tmp/triton-$label"
  serve_ours "$label" "/tmp/triton-$label" "$@"
  if healthy http://127.0.0.1:8181 $pid "$(cap 300)"; then
    started "$label" $((SECONDS - t0)) "$OUT/server_$label.log"
    date -u; bench "$label" http://127.0.0.1:8181
    grep -iE "capture failed|Traceback|error" "$OUT/server_$label.log" | head -5
  else
    echo "$label: server did not come up"; tail -20 "$OUT/server_$label.log"
  fi
  stop $pid
}
restart() {  # ours again on the triton cache `ours` left (a restart on the same machine): ready
  local t0=$SECONDS
  serve_ours ours-restart /tmp/triton-ours
  if healthy http://127.0.0.1:8181 $pid "$(cap 200)"; then
    started ours-restart $((SECONDS - t0)) "$OUT/server_ours-restart.log"
  else
    echo "ours-restart: server did not come up"; tail -20 "$OUT/server_ours-restart.log"
  fi
  stop $pid
}
llama() {  # LABEL ARGS...: llama-server, benched
  local label=$1; shift
  local t0=$SECONDS
  [ -x $LLB/bin/llama-server ] || { echo "$label: no $LLB/bin/llama-server"; return; }
  $LLB/bin/llama-server -m "$MODEL" "$@" --port 8182 >"$OUT/server_$label.log" 2>&1 &
  local pid=$!
  if healthy http://127.0.0.1:8182 $pid "$(cap 240)"; then
    started "$label" $((SECONDS - t0)) "$OUT/server_$label.log" "$*"
    date -u; bench "$label" http://127.0.0.1:8182
  else
    echo "$label did not come up"; tail -20 "$OUT/server_$label.log"
  fi
  stop $pid
}
started() {  # LABEL SECONDS LOG [ARGS]: its start-up line in $OUT/startup_LABEL.txt
  { echo "$1: ready (/health 200) $2 s after launch${4:+ (flags: $4)}"
    grep -E "warm-up|loaded in" "$3" | sed 's/^/    /'; } | tee "$OUT/startup_$1.txt"
}
summary() {  # $OUT/summary.md from what the steps so far left (rewritten after each step)
  local files base f
  files=$(ls "$OUT"/serve_*.json 2>/dev/null)
  {
    echo "# gpu_serve2 $(date -u +%FT%TZ) on $(head -1 "$OUT/machine.txt")"
    if [ -n "$files" ]; then
      base=; [ -f "$OUT/serve_llama-server.json" ] && base="--baseline llama-server"
      echo; python3 tests/perf/serve_report.py $files $base --smi "$OUT"
    fi
    ls "$OUT"/startup_*.txt >/dev/null 2>&1 && { echo; echo "## start-up"; cat "$OUT"/startup_*.txt; }
    [ -s "$OUT/pytest.log" ] && { echo; echo "## gpu tests"; tail -3 "$OUT/pytest.log"; }
    for f in depth_ours depth_llama batched steps_16 steps_64 replay; do
      [ -s "$OUT/$f.md" ] && { echo; echo "## $f"; grep -E "^\|" "$OUT/$f.md"; }
    done
    [ -s "$OUT/kernels.md" ] && { echo; echo "## kernels"; grep -E "^(\||depth|bytes|#)" "$OUT/kernels.md"; }
  } >"$OUT/summary.md"
}
BG=localllm.kernels.quant.triton_linear.BATCH_GEMM=True
bgemm_ok() {  # the batch GEMM's GPU test passed (run once): a wrong kernel still streams tokens
  if [ -z "${BGEMM_RC:-}" ]; then
    timeout "$(cap 120)" python3 -m pytest -q -m gpu -p no:cacheprovider -x \
      tests/kernels/test_batch_gemm.py >"$OUT/pytest_bgemm.log" 2>&1
    BGEMM_RC=$?
    tail -1 "$OUT/pytest_bgemm.log"
  fi
  [ "$BGEMM_RC" = 0 ] || { echo "batch GEMM steps skipped: its GPU test failed"; return 1; }
}
left() { [ $SECONDS -lt "$BUDGET_S" ] || { echo "skip $1: ${SECONDS}s used of BUDGET_S=$BUDGET_S"; return 1; }; }
for step in $STEPS; do
  echo "== $step at ${SECONDS}s"
  case $step in
    tests) timeout "$(cap 150)" python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS 2>&1 \
        | tee "$OUT/pytest.log" | grep -v "^\." | tail -12 ;;
    ours) left ours && model_ready && ours ours ;;
    ours-b2k) left ours-b2k && model_ready && ours ours-b2k -b 2048 ;;
    ours-bgemm) left ours-bgemm && model_ready && bgemm_ok && SW=$BG ours ours-bgemm ;;
    ours-bgemm-b2k) left ours-bgemm-b2k && model_ready && bgemm_ok \
      && SW=$BG ours ours-bgemm-b2k -b 2048 ;;
    ours-shadow) left ours-shadow && model_ready && bgemm_ok \
      && SW="$BG localllm.kernels.quant.triton_linear.HALF_SHADOW=True" ours ours-shadow ;;
    ours-cold-none) left ours-cold-none && model_ready && WARMUP=none ours ours-cold-none ;;
    llama) left llama && model_ready && llama llama-server $LLAMA_ARGS ;;
    llama-old) left llama-old && model_ready && llama llama-server-old $LLAMA_OLD_ARGS ;;
    restart) left restart && model_ready || continue
      if [ -d /tmp/triton-ours ]; then restart; else echo "restart: no triton cache from ours"; fi ;;
    depth) left depth && model_ready || continue
      timeout "$(cap 150)" python3 -m localllm.app bench -m "$MODEL" --device "$DEVICE" -p 0 -n 128 \
        -d "$DEPTHS" -r 3 2>&1 | tee "$OUT/depth_ours.md" | grep -E "^\||rror"
      timeout "$(cap 150)" $LLB/bin/llama-bench -m "$MODEL" -p 0 -n 128 -d "$DEPTHS" -r 3 -fa 1 -ngl 99 \
        -o md 2>&1 | tee "$OUT/depth_llama.md" | grep -E "^\||rror|No such" ;;
    kernels) left kernels && model_ready || continue
      timeout "$(cap 120)" python3 tests/perf/decode_kernels.py "$MODEL" --depth "$KDEPTHS" --device "$DEVICE" \
        2>&1 | tee "$OUT/kernels.md" | tail -60 ;;
    steps) left steps && model_ready || continue  # the engine's steps by kind at STEPS_CONC streams
      for c in ${STEPS_CONC:-16,64}; do c=${c//,/ }; for n in $c; do
        timeout "$(cap 120)" python3 tests/perf/serve_steps.py -m "$MODEL" --device "$DEVICE" --streams $n \
          --requests $((n * 2)) --parallel "$NP" --json "$OUT/steps_$n.json" 2>&1 | tee "$OUT/steps_$n.md" | tail -14
      done; done ;;
    replay) timeout "$(cap 120)" python3 tests/perf/graph_replay_diff.py 2>&1 | tee "$OUT/replay.md" | tail -20 ;;
    batched) left batched && model_ready && [ -x $LLB/bin/llama-batched-bench ] || continue
      timeout "$(cap 100)" $LLB/bin/llama-batched-bench -m "$MODEL" -c $((64 * 1152 + 1024)) -b 2048 -ub 512 \
        -npp 1024 -ntg 128 -npl 1,16,64 -fa on -ngl 99 2>&1 | tee "$OUT/batched.md" | grep -E "^\||rror" ;;
  esac
  summary
done
summary
cat "$OUT/summary.md"
echo "done at ${SECONDS}s"
