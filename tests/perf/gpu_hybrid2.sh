#!/usr/bin/env bash
# One device call (~8 min on an H100/H200; give it the 600 s timeout) for issue 40's hybrids with
# decode CUDA graphs:
# 1. GPU tests: hybrid decode graphs against eager (tests/engine/test_hybrid_graphs.py: replayed
#    rows vs eager decode token by token for lfm2, lfm2moe, granitehybrid(+dense), qwen3next at
#    1, 3-padded-to-4 and 4 sequences; the engine with graphs on vs off, batch of 4, alone, n = 2
#    forks), the hybrids' engine tests (test_hybrid_families_gpu.py, test_qwen3next_gpu.py), the
#    recurrent triton kernels against their references (test_recurrent_gpu.py: the steps in
#    place on the state slots too; test_recurrent_triton.py: with qwen3next.FUSED_DECODE too),
#    the dense graphs' (test_gpu_graphs.py: the rows gained a state-slot column), the hybrid
#    prompt graphs (test_hybrid_prompt_graphs.py), lfm2.FUSED_RESIDUAL's tokens
#    (test_lfm2_fused_residual.py) and granitehybrid.FUSED_RESIDUAL's
#    (test_granite_fused_residual.py).
# 2. `localllm bench -p 512 -n 128 -r 3` and llama.cpp's llama-bench on the same real-shape
#    random-weight Q4_K_M files, made on the device while the tests run: LFM2-1.2B,
#    Granite-4.0-H-Tiny, Qwen3-Next-80B-A3B (Q3N_LAYERS, default 12 of 48), GLM-4.5-Air
#    (GLM_LAYERS, default 10 of 46), Granite-4.0-H-Small (if time and disk allow), SmolLM3-3B
#    and LFM2-8B-A1B. MODELS (default "lfm2 g4t q3n glm s3 l2m g4s") picks and orders them. Each
#    file is deleted once benched. A compact table ends the output ($OUT/table.md).
#
# Carry [".hyb2", ".hyb2w"] (made here by `bash tests/perf/gpu_hybrid2_pack.sh` from .whl and
# .llb: llama-bench with its libraries, stripped, and the gguf and llguidance wheels unpacked;
# 42.7 MB, where .whl + .llb take 47 MB) and run from the repo root:
#   bash tests/perf/gpu_hybrid2.sh        ($OUT: pytest.log, bench.md, table.md)
# A call carries at most 64 MiB with the tree (24.2 MB on 2026-12-06, growing). Past that, two
# calls: carry [".hyb2w", ".hyb2/gguf.tar.xz"] for the tests and our figures (no llama.cpp
# column), then [".hyb2"] with `LLAMA_ONLY=1 bash tests/perf/gpu_hybrid2.sh` for llama.cpp's on
# the same files (made again from the same seeds). Without .hyb2w the wheels come from .whl.
# The files' tokenizer comes from a tracked fixture (no .refbuild needed).
# AB_<name> (e.g. AB_q3n="localllm.engine.runtime.prefill_graphs.STATEFUL=False"): ours once more
# on that file with those switches (tests/perf/with_switches.py), after llama.cpp's run; its rows
# are "<name> ab" in the table. TESTS replaces the test files (empty: no tests). KERNELS (names,
# e.g. "l2m"): tests/perf/decode_kernels.py on those files too, the decode step kernel by kernel
# ($OUT/kernels_<name>.md). TEST_SW (MODULE.NAME=VALUE ...): the tests run with those switches
# set, e.g. the prepared ones before they are turned on.
# Or carry [".serve2"] alone (serve2_prepare.sh: llama-bench's parts and the wheels, ~31 MiB).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-420}  # seconds after which no further model is benched (or waited for)
LLAMA_ONLY=${LLAMA_ONLY:-0}  # 1: only llama.cpp's figures (no tests, no localllm bench)
mkdir -p /tmp/site
for a in .hyb2/gguf.tar.xz .hyb2w/llguidance.tar.xz; do
  [ -f $a ] && xz -d <$a | tar x -C /tmp
done
for w in .whl .serve2/whl; do
  if [ ! -f .hyb2w/llguidance.tar.xz ] && [ -d $w ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      $w/*.whl
    break
  fi
done
ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import gguf" || { echo "carry .hyb2 (or .whl): gguf"; exit 1; }
[ "$LLAMA_ONLY" = 1 ] || python3 -c "import llguidance" \
  || { echo "carry .hyb2w (or .whl): llguidance"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/bench.md"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
TOK=${TOK:-tests/data/families/qwen3next.gguf}  # a converter-made tokenizer, small vocabulary
M=/tmp/models
rm -rf $M  # (a warm machine keeps an earlier call's files and end marks)
mkdir -p $M
LLB=/tmp/llb/bin/llama-bench
for d in .hyb2 .serve2 .llb; do
  if ls $d/llb.part.* >/dev/null 2>&1; then
    mkdir -p /tmp/llb && cat $d/llb.part.* | xz -d | tar x -C /tmp/llb && break
  fi
done
MODELS=${MODELS:-lfm2 g4t q3n glm s3 l2m g4s}
on() { case " $MODELS " in *" $1 "*) return 0 ;; esac; return 1; }
mk() {  # name, then the maker's command; <name>.gguf appears once complete
  local name=$1
  shift
  "$@" -o $M/$name.part >>/tmp/make.log 2>&1 && mv $M/$name.part $M/$name.gguf \
    || echo "$name: making failed" >>/tmp/make.log
}
wait_room() {  # Granite-4.0-H-Small (~19 GiB) waits until at most one file is left unbenched
  while [ "$(ls $M/*.gguf 2>/dev/null | wc -l)" -gt 1 ] || [ ! -f $M/a.done ]; do sleep 2; done
}
# two makers beside the tests (the first four files, ~29 GiB, fit the disk together)
( on lfm2 && mk lfm2 python3 tests/perf/make_hybrid_synthetic.py --shape lfm2-1.2b \
    --tokenizer-from $TOK
  on g4t && mk g4t python3 tests/perf/make_hybrid_synthetic.py --shape granite-4.0-h-tiny \
    --tokenizer-from $TOK
  on glm && mk glm python3 tests/perf/make_glm4moe.py --layers "${GLM_LAYERS:-10}" \
    --tokenizer-from $TOK
  on s3 && mk s3 python3 tests/perf/make_synthetic.py --shape smollm3-3b --tokenizer-from $TOK
  on l2m && mk l2m python3 tests/perf/make_hybrid_synthetic.py --shape lfm2-8b-a1b \
    --tokenizer-from $TOK
  touch $M/a.done ) &
( on q3n && mk q3n python3 tests/perf/make_qwen3next.py --layers "${Q3N_LAYERS:-12}" \
    --tokenizer-from $TOK
  on g4s && wait_room
  if on g4s && [ "$(df -BG --output=avail /tmp | tail -1 | tr -dc 0-9)" -gt 30 ]; then
    mk g4s python3 tests/perf/make_hybrid_synthetic.py --shape granite-4.0-h-small \
      --tokenizer-from $TOK
  fi
  touch $M/done ) &
TESTS=${TESTS-tests/engine/test_hybrid_graphs.py tests/engine/test_hybrid_families_gpu.py \
  tests/engine/test_qwen3next_gpu.py tests/engine/test_gpu_graphs.py \
  tests/kernels/test_recurrent_gpu.py tests/kernels/test_recurrent_triton.py \
  tests/engine/test_hybrid_prompt_graphs.py tests/engine/test_lfm2_fused_residual.py \
  tests/engine/test_granite_fused_residual.py}
PYTEST=(-m pytest)  # TEST_SW: the tests run with those switches set (with_switches.py)
[ -z "${TEST_SW:-}" ] || read -ra PYTEST <<<"tests/perf/with_switches.py $TEST_SW -- -m pytest"
[ "$LLAMA_ONLY" = 1 ] || [ -z "$TESTS" ] || timeout "${TEST_T:-240}" python3 "${PYTEST[@]}" -q \
  -m gpu -p no:cacheprovider -rf $TESTS 2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -25
date -u
echo "| model | test | localllm t/s | llama.cpp t/s | ratio |" >"$OUT/table.md"
echo "|---|---|---:|---:|---:|" >>"$OUT/table.md"
rates() {  # the pp512 / tg128 rows of a bench table: "test t/s"
  grep -E "\| +(pp512|tg128) +\|" "$1" | awk -F'|' '{gsub(/ /, "", $(NF-2)); print $(NF-2), $(NF-1)}'
}
for name in $MODELS; do
  f=$M/$name.gguf
  # (each maker chain marks its end: a.done, done; wait for the file or both ends)
  while [ ! -f $f ] && { [ ! -f $M/done ] || [ ! -f $M/a.done ]; } \
    && [ $(($(date +%s) - T0)) -le "$BUDGET" ]; do
    sleep 2
  done
  [ -f $f ] || { echo "$name: not made (yet)"; continue; }
  if [ $(($(date +%s) - T0)) -gt "$BUDGET" ]; then
    echo "$name: skipped, past ${BUDGET}s"
    rm -f $f
    continue
  fi
  echo "== $name: $(du -h $f | cut -f1)" | tee -a "$OUT/bench.md"
  : >/tmp/ours.md
  [ "$LLAMA_ONLY" = 1 ] || timeout 120 python3 -m localllm.app.bench -m $f -p 512 -n 128 -r 3 \
    --device cuda >/tmp/ours.md 2>/tmp/ours.err
  cat /tmp/ours.md >>"$OUT/bench.md"
  grep -E "not captured|Error|error" /tmp/ours.err 2>/dev/null | tail -3 | tee -a "$OUT/bench.md"
  : >/tmp/theirs.md
  if [ -x $LLB ]; then
    LD_LIBRARY_PATH=/tmp/llb/bin timeout 100 $LLB -m $f -p 512 -n 128 -r 3 -ngl 99 \
      >/tmp/theirs.md 2>/tmp/theirs.err || tail -3 /tmp/theirs.err
    cat /tmp/theirs.md >>"$OUT/bench.md"
  fi
  ab_var=AB_$name
  ab=${!ab_var:-}
  : >/tmp/ab.md
  if [ -n "$ab" ] && [ "$LLAMA_ONLY" != 1 ]; then
    echo "### $name with $ab" >>"$OUT/bench.md"
    # shellcheck disable=SC2086
    timeout 120 python3 tests/perf/with_switches.py $ab -- -m localllm.app.bench -m $f -p 512 \
      -n 128 -r 3 --device cuda >/tmp/ab.md 2>/tmp/ab.err || tail -3 /tmp/ab.err
    cat /tmp/ab.md >>"$OUT/bench.md"
  fi
  case " ${KERNELS:-} " in *" $name "*)
    timeout 120 python3 tests/perf/decode_kernels.py $f --depth 512 >"$OUT/kernels_$name.md" \
      2>/tmp/kern.err || tail -3 /tmp/kern.err
    grep -E "^(depth|\| )" "$OUT/kernels_$name.md" | head -30 >>"$OUT/bench.md" ;;
  esac
  rm -f $f
  for t in pp512 tg128; do
    b=$(rates /tmp/theirs.md | awk -v t=$t '$1 == t {print $2}')
    for run in ours ab; do
      a=$(rates /tmp/$run.md | awk -v t=$t '$1 == t {print $2}')
      [ $run = ab ] && [ -z "$a" ] && continue
      r=$(awk -v a="${a:-0}" -v b="${b:-0}" 'BEGIN { if (a > 0 && b > 0) printf "%.2fx", a / b }')
      label=$name; [ $run = ab ] && label="$name ab"
      echo "| $label | $t | ${a:--} | ${b:--} | ${r:--} |" >>"$OUT/table.md"
    done
  done
  date -u
done
tail -12 /tmp/make.log
echo "files: lfm2 = LFM2-1.2B, g4t = Granite-4.0-H-Tiny, q3n = Qwen3-Next-80B-A3B" \
  "(${Q3N_LAYERS:-12} layers), glm = GLM-4.5-Air (${GLM_LAYERS:-10} layers)," \
  "g4s = Granite-4.0-H-Small, s3 = SmolLM3-3B, l2m = LFM2-8B-A1B; all Q4_K_M random weights"
cat "$OUT/table.md"
date -u
