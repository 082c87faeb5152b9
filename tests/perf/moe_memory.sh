#!/usr/bin/env bash
# MoE decode beside llama.cpp with each process's device memory (issue 7): run by
# `STEPS=lab LAB=tests/perf/moe_memory.sh MOE=1 bash tests/perf/h200_session.sh` on the H200
# (it needs /tmp/moe.gguf and the llama-bench that script unpacks). Per run: tokens/s, our
# torch figures (after loading, peak allocated, peak reserved) and the peak of nvidia-smi's
# memory.used every 100 ms (the whole process, CUDA context included).
M=${M:-/tmp/moe.gguf}
LB=${LB:-/tmp/llb/bin/llama-bench}
ours() { timeout 150 python3 -m localllm.app.bench -m "$M" --device cuda "$@" 2>&1 |
  grep -E "qwen3moe|expert|graphs|memory|Error|rror"; }
# the same after the Python statements in $1 (a variant patched into the library for one run)
ours_py() {
  local patch=$1; shift
  timeout 150 python3 -c "import sys
$patch
from localllm.app.bench import main; sys.exit(main(sys.argv[1:]))" -m "$M" --device cuda "$@" 2>&1 |
    grep -E "qwen3moe|expert|graphs|memory|Error|rror"; }
polled() {
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >/tmp/poll.txt &
  local pp=$!
  "$@"
  kill $pp; wait $pp 2>/dev/null
  echo "nvidia-smi peak MiB: $(sort -n /tmp/poll.txt | tail -1)"
}
llama() { timeout 100 "$LB" -m "$M" -ngl 99 -fa 1 "$@" 2>&1 | grep -E "^\| q|error"; }
# one run under its title; ONLY (an extended regex) picks the titles to run
section() {
  local title=$1; shift
  [[ -z "${ONLY:-}" || "$title" =~ $ONLY ]] || return 0
  echo "== $title"; polled "$@"
}
date -u
[[ -z "${ONLY:-}" || "plan" =~ $ONLY ]] && python3 -m localllm.app run -m "$M" --device cuda --mem-budget ${PLAN_BUDGET:-10GiB} -c 4096 --show-plan 2>&1 | head -${PLAN_LINES:-30}
# the CUDA context and cuBLAS's workspace alone: what no torch figure counts
section "torch's CUDA context + one fp16 matmul" python3 -c "import torch
a = torch.randn(4096, 4096, device='cuda', dtype=torch.float16); (a @ a).sum().item()
import time; time.sleep(0.5); print('torch reserved MiB', torch.cuda.memory_reserved() >> 20)"
section "(a) all on the GPU" ours -p 0 -n 64 -r 3
section "(a) llama.cpp" llama -p 0 -n 64 -r 3
section "(b) llama.cpp -ot exps=CPU" llama -p 0 -n 64 -r 3 -ot exps=CPU
# llama.cpp with about our (b) footprint: the last two layers' experts on the GPU
section "(b) llama.cpp -ncmoe 46" llama -p 0 -n 64 -r 3 -ncmoe 46
# (b) under a budget: no prompt copy, the plan's minimum (the CUDA context included)
section "(b) --cpu-moe split, 2.2 GiB" ours -p 0 -n 64 -r 3 --cpu-moe --host-compute split --mem-budget 2.2GiB
# the same from an older tree exported to .ab (an A/B in one call; h200_session.sh links it)
ours_ab() { PYTHONPATH=/tmp/absite:/tmp/site ours "$@"; }
[ -d .ab ] && mkdir -p /tmp/absite && ln -sfn "$PWD/.ab" /tmp/absite/localllm
section "(b) split 2.2 GiB, .ab tree" ours_ab -p 0 -n 64 -r 3 --cpu-moe --host-compute split --mem-budget 2.2GiB
# the same with libgomp's threads spinning between layers instead of sleeping after ~300k spins
ours_active() { OMP_WAIT_POLICY=ACTIVE ours "$@"; }
# the split with another CPU share (SHARE: `engine.moe.block.split`'s share, over slots too)
ours_share() { ours_py "from localllm.engine.moe import residency as moe_residency, split as moe_split
moe_split.SPLIT_CPU_SHARE = moe_residency.SPLIT_CPU_SHARE_SLOTS = $SHARE" "$@"; }
# the share as a user sets it (its footer line says how the two sides waited)
section "(b) split 2.2 GiB, --split-share 0.5" ours -p 0 -n 64 -r 3 --cpu-moe --host-compute split --mem-budget 2.2GiB --split-share 0.5
for SHARE in ${SHARES:-}; do  # SHARES="0.375 0.5": the floor's split, and split over 3 GiB's slots
  section "(b) split 2.2 GiB, CPU share $SHARE" ours_share -p 0 -n 64 -r 3 --cpu-moe --host-compute split --mem-budget 2.2GiB
  section "(b) split 3 GiB, CPU share $SHARE" ours_share -p 0 -n 64 -r 3 --mem-budget 3GiB --host-compute split
done
section "(b) split 2.2 GiB, OMP active" ours_active -p 0 -n 64 -r 3 --cpu-moe --host-compute split --mem-budget 2.2GiB
section "(b) --cpu-moe mapped, 2.2 GiB" ours -p 0 -n 64 -r 3 --cpu-moe --host-compute mapped --mem-budget 2.2GiB
# host experts with 512 device slots over them: mapped alone, and split (the CPU takes misses)
section "(b) mapped over 512 slots" ours -p 0 -n 64 -r 3 --cpu-moe --host-compute mapped --expert-slots 512
section "(b) split over 512 slots" ours -p 0 -n 64 -r 3 --cpu-moe --host-compute split --expert-slots 512
# (b) beside llama.cpp at about its footprints: auto-fit alone (split where no slots cover the
# host experts), and budgets llama.cpp fills with whole layers' experts (392 MiB each)
section "(b) auto-fit, 2.2 GiB" ours -p 0 -n 64 -r 3 --mem-budget 2.2GiB
section "(b) auto-fit, 3 GiB" ours -p 0 -n 64 -r 3 --mem-budget 3GiB
section "(b) llama.cpp -ncmoe 44" llama -p 0 -n 64 -r 3 -ncmoe 44
# the crossover near 3 GiB: two layers' experts on the GPU and the rest split (no slots), and
# llama.cpp with one layer's experts on the GPU, about our floor's footprint
section "(b) split, --n-cpu-moe 46" ours -p 0 -n 64 -r 3 --n-cpu-moe 46 --host-compute split
section "(b) llama.cpp -ncmoe 47" llama -p 0 -n 64 -r 3 -ncmoe 47
section "(b) auto-fit, 4.5 GiB" ours -p 0 -n 64 -r 3 --mem-budget 4.5GiB
section "(b) llama.cpp -ncmoe 40" llama -p 0 -n 64 -r 3 -ncmoe 40
section "(b) split, 4.5 GiB" ours -p 0 -n 64 -r 3 --mem-budget 4.5GiB --host-compute split
section "split, 6 GiB" ours -p 0 -n 64 -r 3 --mem-budget 6GiB --host-compute split
section "auto-fit, 10 GiB" ours -p 0 -n 64 -r 3 --mem-budget 10GiB
section "llama.cpp -ncmoe 24" llama -p 0 -n 64 -r 3 -ncmoe 24
section "auto-fit, 6 GiB" ours -p 0 -n 64 -r 3 --mem-budget 6GiB
section "llama.cpp -ncmoe 36" llama -p 0 -n 64 -r 3 -ncmoe 36
section "(c) disk, 3,072 slots" ours -p 0 -n 64 -r 3 --experts disk --expert-slots 3072
# (c)'s misses packed straight from the staging rows over the bus (unified memory's path), and
# read on 8 threads (the default before ebf5af5; 16 since): what each changes on a discrete GPU
slots_with() {  # FileSlots made with the keyword argument $1 (e.g. "in_place=True")
  echo "from localllm.offload import file_experts as f; i = f.FileSlots.__init__
f.FileSlots.__init__ = lambda self, *a, **k: i(self, *a, **{**k, **dict($1)})"; }
section "(c) disk, 3,072 slots, in place" ours_py "$(slots_with in_place=True)" -p 0 -n 64 -r 3 --experts disk --expert-slots 3072
section "(c) disk, 3,072 slots, 8 threads" ours_py "$(slots_with threads=8)" -p 0 -n 64 -r 3 --experts disk --expert-slots 3072
# (c) with more programs per staged expert crossing the bus (and packing): PROGS="128 256"
for P in ${PROGS:-}; do
  section "(c) disk, 3,072 slots, $P programs" ours_py "from localllm.kernels.moe import slot_requests
slot_requests.PROGRAMS = $P" -p 0 -n 64 -r 3 --experts disk --expert-slots 3072
done
section "(c) disk, 3,072 slots, tg128" ours -p 0 -n 128 -r 2 --experts disk --expert-slots 3072
# (c) in llama.cpp -ncmoe 24's device memory (9,943 MiB): the slots the budget leaves
section "(c) disk, 9.7 GiB" ours -p 0 -n 64 -r 3 --experts disk --mem-budget 9.7GiB
date -u
