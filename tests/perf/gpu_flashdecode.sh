#!/usr/bin/env bash
# One device call for issue 38's long-context decode (about 5 minutes on an H100): the
# flash-decoding split over each sequence's real keys (`kernels/attention/triton_split.py`, the
# "span" split) against the previous one over the graph bucket's m keys ("chunk"), in order:
#   tests   the GPU tests of decode attention (-m gpu: the flash kernels against the torch
#           reference, the combine's quantized rows, the decode graphs), while the file is written
#   attn    tests/perf/bench_attention.py --sweep: chunk vs span (and span's launch grid) at depths
#           192 / 512 / 4K / 8K / 32K x 1 sequence, 16 x 2K, 64 x 1K, 64 x 2K (+64 keys: mid-tg128),
#           8B shape, graph-bucket plans, us per layer and GB/s of the real keys against a copy's;
#           the fastest span launch goes to $OUT/best.json
#   span    `localllm bench -d 8192,32768` tg128 with the span split at that launch
#   llama   `llama-bench -d 8192,32768` tg128 -fa 1 on the same file
#   chunk   `localllm bench -d ...` with the chunk split (skipped when past BUDGET_S)
# then a summary ($OUT/summary.md). File: the Llama-3.1-8B shape, Q4_K_M, make_synthetic.py as
# gpu_serve2.sh writes it (a warm machine reuses /tmp/serve2-llama3-8b.gguf).
#
# From the repo root, carrying .serve2 (gpu_serve2.sh's: llama.cpp 3f545bec's bin for sm_90, the
# gguf/llguidance wheels, the tokenizer; `bash tests/perf/serve2_prepare.sh` makes it):
#   bash tests/perf/gpu_flashdecode.sh            carry [".serve2"]      (timeout_s 600)
# Knobs: STEPS ("tests attn span llama chunk"), DEPTHS (8192,32768), REPS (1), SWEEP (--sweep; empty
# for the three main variants only), BUDGET_S (a step that would start later is skipped: 240),
# END_S (every step's timeout ends by then: 330).
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-tests attn span llama chunk}
DEPTHS=${DEPTHS:-8192,32768}
REPS=${REPS:-1}
SWEEP=${SWEEP---sweep}
BUDGET_S=${BUDGET_S:-240}
LLB=${LLB:-/tmp/llb}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .serve2/whl/gguf-*.whl .serve2/whl/llguidance-*.whl 2>&1 | tail -2
[ -x $LLB/bin/llama-bench ] || { mkdir -p $LLB && cat .serve2/llb.part.* | xz -d | tar x -C $LLB; }
mkdir -p /tmp/site && ln -sfn "$PWD" /tmp/site/localllm
export PYTHONPATH=/tmp/site:$PWD
export LD_LIBRARY_PATH=$LLB/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; date -u; } | tee "$OUT/machine.txt"
MODEL=/tmp/serve2-llama3-8b.gguf
if [ ! -f "$MODEL.done" ]; then
  (python3 tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o "$MODEL" --text-head \
    --tokenizer-from .serve2/smollm2-tok.gguf >/tmp/make_fd.log 2>&1 && touch "$MODEL.done") &
  GEN_PID=$!
fi
model_ready() { [ -z "${GEN_PID:-}" ] || wait $GEN_PID; GEN_PID=; [ -f "$MODEL.done" ] || { tail -3 /tmp/make_fd.log; return 1; }; }
cap() { local t=$((${END_S:-330} - SECONDS)); [ "$t" -lt "$1" ] || t=$1; [ "$t" -gt 5 ] || t=5; echo $t; }
left() { [ $SECONDS -lt "$BUDGET_S" ] || { echo "skip $1: ${SECONDS}s used of BUDGET_S=$BUDGET_S"; return 1; }; }
ours() {  # LABEL KERNEL [best.json]: localllm bench tg128 at DEPTHS with that split
  timeout "$(cap 110)" python3 -c "
import json, sys
from localllm.kernels.attention import triton_decode, triton_split
triton_decode.SPLIT_KERNEL = '$2'
if len(sys.argv) > 1 and sys.argv[1].endswith('.json'):
    best = json.load(open(sys.argv.pop(1)))['tune']
    triton_split.TUNE.update({k: v for k, v in best.items() if v is not None})
    print('span TUNE', triton_split.TUNE, file=sys.stderr)
from localllm.app.bench import main
sys.exit(main(sys.argv[1:]))" ${3:-} -m "$MODEL" --device cuda -p 0 -n 128 -d "$DEPTHS" -r "$REPS" \
    2>&1 | tee "$OUT/depth_$1.md" | grep -E "^\||rror|TUNE"
}
for step in $STEPS; do
  echo "== $step at ${SECONDS}s"
  case $step in
    tests) timeout "$(cap 100)" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_flash_decode.py tests/engine/test_combine_quant.py \
        tests/engine/test_gpu_graphs.py 2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -8 ;;
    attn) left attn || continue
      timeout "$(cap 130)" python3 tests/perf/bench_attention.py $SWEEP --best "$OUT/best.json" \
        2>&1 | tee "$OUT/attn.md" | grep -vE "\| sweep " | tail -30 ;;
    span) left span && model_ready || continue
      best=; [ -s "$OUT/best.json" ] && best=$OUT/best.json
      ours span span $best ;;
    chunk) left chunk && model_ready && ours chunk chunk ;;
    llama) left llama && model_ready || continue
      timeout "$(cap 90)" $LLB/bin/llama-bench -m "$MODEL" -p 0 -n 128 -d "$DEPTHS" -r "$REPS" \
        -fa 1 -ngl 99 -o md 2>&1 | tee "$OUT/depth_llama.md" | grep -E "^\||rror|No such" ;;
  esac
done
python3 - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import re, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("# gpu_flashdecode on " + (out / "machine.txt").read_text().splitlines()[0])
log = (out / "pytest.log").read_text().splitlines() if (out / "pytest.log").exists() else []
print("tests: " + (next((x for x in reversed(log) if " passed" in x or " failed" in x), "not run")))
attn = (out / "attn.md").read_text() if (out / "attn.md").exists() else ""
first = attn.splitlines()[0] if attn else ""
print(first)
rows = {}
for line in attn.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) == 7 and cells[3].replace(".", "").isdigit():
        rows.setdefault(cells[0], {})[cells[2]] = (float(cells[3]), cells[4], cells[5], cells[6])
best = re.search(r"best: (.*) ->", attn)
best = best.group(1) if best else None
print("\n| case | chunk us (GB/s, % copy) | span us (GB/s, % copy) | span x | native us | "
      f"best sweep{' (' + best + ')' if best else ''} us (GB/s) |")
print("|---|---|---|---:|---:|---|")
for case, v in rows.items():
    c, s, n, b = (v.get(k) for k in ("chunk exact", "span exact", "span native", best))
    f = lambda r: f"{r[0]:.1f} ({r[1]}, {r[2]} %)" if r else "-"
    x = f"{c[0] / s[0]:.2f}" if c and s else "-"
    print(f"| {case} | {f(c)} | {f(s)} | {x} | {n[0] if n else '-'} | {f(b)} |")
for line in attn.splitlines():
    if line.startswith(("summed", "span launches", "best")):
        print(line)
print()
for name in ("span", "chunk", "llama"):
    p = out / f"depth_{name}.md"
    if p.exists():
        for line in p.read_text().splitlines():
            if line.startswith("|") and "tg" in line:
                print(f"{name}: {line}")
EOF
echo "done at ${SECONDS}s"
