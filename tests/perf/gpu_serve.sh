#!/usr/bin/env bash
# Device calls for issue 38, part 1 (many streams): `localllm serve` and llama.cpp's `llama-server`
# on the same synthetic GGUF (Llama-3.1-8B shape, Q4_K_M), each driven by tests/perf/bench_serve.py
# at 1, 4, 16 and 64 concurrent streams (prompts 512-2,048 tokens with shared prefixes, 256 tokens
# generated), then llama.cpp's llama-batched-bench. $OUT gets serve.md (the tables, with the GPU's
# busy share per level: a server whose GPU idles is bound by its host), serve_*.json, smi_*.csv,
# the servers' logs. Results: tests/perf/results/server.md. Run from the repo root.
#
# Prepare on the development machine, once (wheels, the tokenizer, llama.cpp with its server):
#   LLAMA=/work/.mirror/ngxson+llama.cpp/repo SERVE=1 bash tests/perf/h200_prepare.sh
# Call 1, the build (llama-server, llama-batched-bench; minutes) and, beside it, the GPU tests of
# the decode graphs (the ladder to 64 rows; decode ahead, whose rows are now built per launch):
#   STEPS="build tests keep" bash tests/perf/gpu_serve.sh
#   carry [".whl", ".whlserve", ".refbuild"]; put the lls.part.* it returns into .lls/
# Call 2, the measurements (about 8 minutes):
#   bash tests/perf/gpu_serve.sh
#   carry [".whl", ".whlserve", ".refbuild/smollm2-tok.gguf", ".lls"] (a machine still warm from
#   call 1 has /tmp/lls already; then .lls may be left out). Binaries that gpu_build_llamacpp.sh
#   made (.llb, with llama-server and llama-batched-bench) serve as well: carry .llb instead.
# MoE (optional, its own call; the 17 GiB file takes minutes to write):
#   SHAPE=qwen3moe-30b-a3b STEPS="tuned llama ours" bash tests/perf/gpu_serve.sh
# Knobs: STEPS ("tuned llama ours batched"), CONC (1,4,16,64), GEN (256), NP (64), SHAPE
# (llama3-8b), LEVEL_S (seconds a level may start measured requests: 60), BUDGET_S (skip steps
# that would start after this many seconds: 480), BENCH_ARGS (more bench_serve.py flags).
#   ours:    localllm serve, decode graphs as shipped (batch ladder 1-8; larger steps run eager)
#   tuned:   the same with the graph ladder 1, 2, 4, ..., 64 (tests/engine/test_graph_ladder.py
#            checks it) and 2,048 tokens a step (prompt chunks; sim_schedule.py: 93 % of the output
#            tokens at 64 streams then come from graph steps, against 0.1 % as shipped)
#   ladder:  (optional) the ladder alone
#   llama:   llama-server -np NP -c NP*2560 -fa on -ngl 99
#   batched: llama-batched-bench -npp 1024 -ntg 128 -npl 1,4,16,64
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-tuned llama ours batched}
CONC=${CONC:-1,4,16,64}
GEN=${GEN:-256}
NP=${NP:-64}
SHAPE=${SHAPE:-llama3-8b}
LEVEL_S=${LEVEL_S:-60}
BUDGET_S=${BUDGET_S:-480}
DEVICE=${DEVICE:-cuda}
if [ -z "${NO_INSTALL:-}" ]; then  # (NO_INSTALL=1 DEVICE=cpu: a dry run of the steps on a CPU)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/site && ln -sfn "$PWD" /tmp/site/localllm
if [ -d .whlserve ] && [ -z "${NO_INSTALL:-}" ]; then  # the server's stack, behind the image's own packages (a .pth appends)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 \
    .whlserve/*.whl 2>&1 | tail -2
  python3 -c "import site, pathlib; d = pathlib.Path(site.getsitepackages()[0]); \
    (d / 'zz_localllm_serve.pth').write_text('/tmp/site2\n')" 2>/dev/null || SITE2=:/tmp/site2
fi
export PYTHONPATH=/tmp/site:$PWD${SITE2:-}  # (site-packages not writable: after ours, before its)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/machine.txt"
python3 -c "import torch, triton, fastapi, httpx; print('torch', torch.__version__, 'triton', \
  triton.__version__, 'fastapi', fastapi.__version__, 'httpx', httpx.__version__)" | tee -a "$OUT/machine.txt"
nproc | sed 's/^/cpus /' | tee -a "$OUT/machine.txt"
date -u
# llama.cpp's build: kept on a warm machine, else unpacked from carried parts: .lls from this
# script's `keep`, or .llb from gpu_build_llamacpp.sh (the same tar of bin/; each to the folder it
# was built in, where its run path points)
LLS=/tmp/lls
for d in lls llb; do
  if [ ! -x /tmp/$d/bin/llama-server ] && [ -d .$d ]; then
    mkdir -p /tmp/$d && cat .$d/$d.part.* | xz -d | tar x -C /tmp/$d
  fi
  [ -x /tmp/$d/bin/llama-server ] && { LLS=/tmp/$d; break; }
done
export LD_LIBRARY_PATH=$LLS/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
case $SHAPE in
  llama3-8b) CTX=131072 ;;  # our KV pool: this many tokens (the model's whole context)
  qwen3moe-30b-a3b) CTX=40960 ;;
  *) CTX=2048 ;;  # tiny shapes (dry runs)
esac
MODEL=/tmp/serve-$SHAPE.gguf
need_model=
for s in $STEPS; do case $s in ours|ladder|tuned|llama|batched) need_model=1 ;; esac; done
if [ -n "$need_model" ] && [ ! -f "$MODEL.done" ]; then  # a warm machine reuses the file
  (python3 tests/perf/make_synthetic.py --shape "$SHAPE" --quant Q4_K_M -o "$MODEL" \
    --tokenizer-from .refbuild/smollm2-tok.gguf >/tmp/make_serve.log 2>&1 && touch "$MODEL.done") &
  GEN_PID=$!
fi
model_ready() { [ -z "${GEN_PID:-}" ] || wait $GEN_PID; [ -f "$MODEL.done" ] || { tail -3 /tmp/make_serve.log; return 1; }; }
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
  if command -v nvidia-smi >/dev/null; then  # GPU busy % and memory, 4 a second (serve_report --smi)
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits \
      -lms 250 >"$OUT/smi_$1.csv" 2>/dev/null &
    smi=$!
  fi
  timeout 420 python3 tests/perf/bench_serve.py --url "$2" --label "$1" --concurrency "$CONC" \
    --gen "$GEN" --max-seconds "$LEVEL_S" --json "$OUT/serve_$1.json" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/serve.log"
  [ -z "$smi" ] || kill "$smi" 2>/dev/null
}
stop() { kill "$1" 2>/dev/null; for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done; kill -9 "$1" 2>/dev/null; }
ours() {  # LABEL [python code run before the CLI]: localllm serve, benched, stopped
  local pre=${2:-}
  python3 -c "import sys; ${pre}from localllm.app.cli import main; sys.exit(main(sys.argv[1:]))" \
    serve -m "$MODEL" --device "$DEVICE" -np "$NP" -c "$CTX" --port 8181 >"$OUT/server_$1.log" 2>&1 &
  local pid=$!
  if healthy http://127.0.0.1:8181 $pid 300; then
    date -u; bench "$1" http://127.0.0.1:8181
    grep -iE "capture failed|Traceback|error" "$OUT/server_$1.log" | head -5
  else
    echo "$1: server did not come up"; tail -20 "$OUT/server_$1.log"
  fi
  stop $pid
}
# what `ladder` and `tuned` change, in the server process before its CLI runs (printed to its log)
LADDER="import localllm.engine.runtime.cuda_graphs as g; assert len(g.DecodeGraphs.__init__.__defaults__) == 1; \
g.DecodeGraphs.__init__.__defaults__ = ((1, 2, 4, 8, 16, 32, 64),); print('decode graph ladder', \
g.DecodeGraphs.__init__.__defaults__, file=sys.stderr); "
BATCH2K="import localllm.app.serve as s; k = s.engine_kwargs; s.engine_kwargs = lambda a: \
print('engine', {**k(a), 'max_num_batched_tokens': 2048}, file=sys.stderr) or {**k(a), 'max_num_batched_tokens': 2048}; "
left() { [ $SECONDS -lt "$BUDGET_S" ] || { echo "skip $1: ${SECONDS}s used of BUDGET_S=$BUDGET_S"; return 1; }; }
for step in $STEPS; do
  case $step in
    build) if [ -x $LLS/bin/llama-server ]; then echo "llama.cpp: built already"; else
        date -u  # in the background: the steps after it (tests) run beside it, `keep` waits
        (cmake -S .refbuild/llama.cpp -B $LLS -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
          -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
          -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF >/tmp/lls_build.log 2>&1 &&
          cmake --build $LLS --target llama-server llama-batched-bench -j "$(nproc)" \
            >>/tmp/lls_build.log 2>&1) &
        BLD=$!
      fi ;;
    keep) [ -z "${BLD:-}" ] || { wait $BLD; echo "build rc=$?"; tail -3 /tmp/lls_build.log; cp /tmp/lls_build.log "$OUT/"; }
      # the two programs and their libraries only: the parts travel in the next call's carry
      [ -x $LLS/bin/llama-server ] && (cd $LLS && tar c bin/llama-server bin/llama-batched-bench \
        bin/*.so* | xz -T0 -6 | split -b 15M - "$OUT/lls.part.") &&
        ls -la "$OUT"/lls.part.* ;;
    tests) timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_graph_ladder.py \
        tests/engine/test_gpu_graphs.py tests/engine/test_decode_ahead.py tests/engine/test_gpu_engine.py \
        2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -15 ;;
    ours) left ours && model_ready && ours ours ;;
    ladder) left ladder && model_ready && ours ladder "$LADDER" ;;
    tuned) left tuned && model_ready && ours tuned "$LADDER$BATCH2K" ;;
    llama) left llama && model_ready || continue
      [ -x $LLS/bin/llama-server ] || { echo "llama: no llama-server (build it: STEPS=build keep)"; continue; }
      $LLS/bin/llama-server -m "$MODEL" -np "$NP" -c $((NP * 2560)) -fa on -ngl 99 --port 8182 \
        >"$OUT/server_llama.log" 2>&1 &
      pid=$!
      if healthy http://127.0.0.1:8182 $pid 300; then
        date -u; bench llama-server http://127.0.0.1:8182
      else
        echo "llama-server did not come up"; tail -20 "$OUT/server_llama.log"
      fi
      stop $pid ;;
    batched) left batched && model_ready && [ -x $LLS/bin/llama-batched-bench ] || continue
      date -u
      timeout 180 $LLS/bin/llama-batched-bench -m "$MODEL" -c $((64 * 1152 + 1024)) -b 2048 -ub 512 \
        -npp 1024 -ntg 128 -npl 1,4,16,64 -fa on -ngl 99 2>&1 | tee "$OUT/batched.md" | grep -E "^\||error" ;;
  esac
  date -u
done
files=$(ls "$OUT"/serve_*.json 2>/dev/null)
if [ -n "$files" ]; then
  base=; [ -f "$OUT/serve_llama-server.json" ] && base="--baseline llama-server"
  python3 tests/perf/serve_report.py $files $base --smi "$OUT" | tee "$OUT/serve.md"
fi
date -u
