#!/usr/bin/env bash
# One device call for issue 38 (about 8-9 minutes on an H100): on one synthetic GGUF
# (Llama-3.1-8B shape, Q4_K_M, SmolLM2's tokenizer, `--text-head`: the output head never picks a
# token that is not valid UTF-8, so llama-server's output parser accepts every reply), in order:
#   tests    GPU tests of the decode-graph ladder (default now 1-64 rows), while the file is written
#   ours     `localllm serve` as shipped (-np 64), tests/perf/bench_serve.py at CONC streams
#   llama    llama-server -np 64 -c 64*2560 -fa on -ngl 99, the same client, prompts and lengths
#            (token-id prompts 512-2,048 with shared prefixes, 256 tokens each: ignore_eos, and
#            min_tokens for ours; streaming /v1/completions)
#   depth    tg128 at depth 8K and 32K: `localllm bench -d` and `llama-bench -d`, same file
#   kernels  the 8B decode step kernel by kernel (tests/perf/decode_kernels.py: share of the step,
#            bytes moved against the measured copy bandwidth), depth 512 and 8K
#   batched  llama-batched-bench -npp 1024 -ntg 128 -npl 1,16,64
#   ours-b2k ours with `-b 2048` (prompt chunks of 2,048 tokens a step): last, so it runs only if
#            time is left (BUDGET_S)
# then one table ($OUT/summary.md; serve_report.py gives no ratio at a level where either server
# failed a request). $OUT: summary.md, serve_*.json, the logs. Results: tests/perf/results/server.md.
#
# Prepare once on the development machine: bash tests/perf/serve2_prepare.sh (makes .serve2/,
# ~31 MiB: llama.cpp 3f545bec's llama-server, llama-bench and llama-batched-bench built for sm_90,
# the wheels, the tokenizer). Then the device call, from the repo root:
#   bash tests/perf/gpu_serve2.sh        carry [".serve2"]          (timeout_s 600)
# Knobs: STEPS ("tests ours llama depth kernels batched ours-b2k"), CONC (1,16,64), GEN (256), NP (64),
# LEVEL_S (a level starts no measured request after this many seconds: 30), BUDGET_S (a step that
# would start after this many seconds is skipped: 470), END_S (every step's timeout ends by then:
# 575, inside the device's 600 s), DEPTHS (8192,32768), KDEPTHS (the kernel
# breakdown's depths: 512,8192), BENCH_ARGS (more
# bench_serve.py flags). A dry run on a CPU (a CPU build of llama.cpp's bin/ in LLB):
#   NO_INSTALL=1 DEVICE=cpu SHAPE=tiny NP=4 CONC=1,2 GEN=16 DEPTHS=256 LLB=... BENCH_ARGS="--min-prompt
#   256 --max-prompt 1024 --system 128 --docs 128,256,512" bash tests/perf/gpu_serve2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-tests ours llama depth kernels batched ours-b2k}
CONC=${CONC:-1,16,64}
GEN=${GEN:-256}
NP=${NP:-64}
SHAPE=${SHAPE:-llama3-8b}
LEVEL_S=${LEVEL_S:-30}
BUDGET_S=${BUDGET_S:-470}
DEPTHS=${DEPTHS:-8192,32768}
KDEPTHS=${KDEPTHS:-512,8192}
DEVICE=${DEVICE:-cuda}
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
ours() {  # LABEL [serve flags]: localllm serve, benched, stopped
  local label=$1; shift
  python3 -m localllm.app serve -m "$MODEL" --device "$DEVICE" -np "$NP" -c "$CTX" --port 8181 "$@" \
    >"$OUT/server_$label.log" 2>&1 &
  local pid=$!
  if healthy http://127.0.0.1:8181 $pid "$(cap 240)"; then
    date -u; bench "$label" http://127.0.0.1:8181
    grep -iE "capture failed|Traceback|error" "$OUT/server_$label.log" | head -5
  else
    echo "$label: server did not come up"; tail -20 "$OUT/server_$label.log"
  fi
  stop $pid
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
    for f in depth_ours depth_llama batched; do
      [ -s "$OUT/$f.md" ] && { echo; echo "## $f"; grep -E "^\|" "$OUT/$f.md"; }
    done
    [ -s "$OUT/kernels.md" ] && { echo; echo "## kernels"; grep -E "^(\||depth|bytes|#)" "$OUT/kernels.md"; }
  } >"$OUT/summary.md"
}
left() { [ $SECONDS -lt "$BUDGET_S" ] || { echo "skip $1: ${SECONDS}s used of BUDGET_S=$BUDGET_S"; return 1; }; }
for step in $STEPS; do
  echo "== $step at ${SECONDS}s"
  case $step in
    tests) timeout "$(cap 120)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_graph_ladder.py \
        2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -6 ;;
    ours) left ours && model_ready && ours ours ;;
    ours-b2k) left ours-b2k && model_ready && ours ours-b2k -b 2048 ;;
    llama) left llama && model_ready || continue
      [ -x $LLB/bin/llama-server ] || { echo "llama: no $LLB/bin/llama-server"; continue; }
      $LLB/bin/llama-server -m "$MODEL" -np "$NP" -c $((NP * 2560)) -fa on -ngl 99 --port 8182 \
        >"$OUT/server_llama.log" 2>&1 &
      pid=$!
      if healthy http://127.0.0.1:8182 $pid "$(cap 240)"; then
        date -u; bench llama-server http://127.0.0.1:8182
      else
        echo "llama-server did not come up"; tail -20 "$OUT/server_llama.log"
      fi
      stop $pid ;;
    depth) left depth && model_ready || continue
      timeout "$(cap 150)" python3 -m localllm.app bench -m "$MODEL" --device "$DEVICE" -p 0 -n 128 \
        -d "$DEPTHS" -r 3 2>&1 | tee "$OUT/depth_ours.md" | grep -E "^\||rror"
      timeout "$(cap 150)" $LLB/bin/llama-bench -m "$MODEL" -p 0 -n 128 -d "$DEPTHS" -r 3 -fa 1 -ngl 99 \
        -o md 2>&1 | tee "$OUT/depth_llama.md" | grep -E "^\||rror|No such" ;;
    kernels) left kernels && model_ready || continue
      timeout "$(cap 120)" python3 tests/perf/decode_kernels.py "$MODEL" --depth "$KDEPTHS" --device "$DEVICE" \
        2>&1 | tee "$OUT/kernels.md" | tail -60 ;;
    batched) left batched && model_ready && [ -x $LLB/bin/llama-batched-bench ] || continue
      timeout "$(cap 100)" $LLB/bin/llama-batched-bench -m "$MODEL" -c $((64 * 1152 + 1024)) -b 2048 -ub 512 \
        -npp 1024 -ntg 128 -npl 1,16,64 -fa on -ngl 99 2>&1 | tee "$OUT/batched.md" | grep -E "^\||rror" ;;
  esac
  summary
done
summary
cat "$OUT/summary.md"
echo "done at ${SECONDS}s"
