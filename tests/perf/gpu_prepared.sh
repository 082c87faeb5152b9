#!/usr/bin/env bash
# The decode switches prepared on 2026-12-08 without a GPU (tests/perf/results/hybrid.md, its
# 02:07-02:37 UTC sections), each off until this A/B: two device calls of ~9 minutes through
# gpu_hybrid2.sh (ours, llama.cpp's llama-bench and ours with the switches on the same
# real-shape random-weight Q4_K_M file, in one call). Carry [".serve2"]; from the repo root:
#   CALL=1 bash tests/perf/gpu_prepared.sh   the switches' GPU tests; GLM-4.5-Air (10 layers):
#            widen.NATIVE_Q5_0 + moe.block.SHARED_IN_NORM; Granite-4.0-H-Tiny:
#            granitehybrid.FUSED_RESIDUAL + FUSED_MIXER + SHARED_IN_NORM
#   CALL=2 bash tests/perf/gpu_prepared.sh   LFM2-8B-A1B and LFM2-1.2B: lfm2.CONV_QUANT;
#            Qwen3-Next (12 layers): qwen3next.FUSED_NORMS
# $OUT as gpu_hybrid2.sh's (bench.md: each model's "### <name> with <switches>" rows).
set -u
M=localllm.engine.moe.block.SHARED_IN_NORM=True
G=localllm.engine.models.granitehybrid
case ${CALL:-1} in
  1)
    export MODELS="glm g4t"
    export AB_glm="localllm.kernels.quant.widen.NATIVE_Q5_0=True $M"
    export AB_g4t="$G.FUSED_RESIDUAL=True $G.FUSED_MIXER=True $M"
    export TESTS="tests/kernels/test_q5_0_native.py tests/engine/test_glm4moe_packed.py \
tests/engine/test_granite_fused_residual.py tests/kernels/test_fused.py \
tests/kernels/test_gated_norm.py tests/kernels/test_recurrent_gpu.py \
tests/kernels/test_recurrent_triton.py tests/engine/test_qwen3next_gpu.py"
    export TEST_T=${TEST_T:-200}
    ;;
  2)
    export MODELS="l2m q3n lfm2"
    export AB_l2m="localllm.engine.models.lfm2.CONV_QUANT=True"
    export AB_lfm2="$AB_l2m"
    export AB_q3n="localllm.engine.models.qwen3next.FUSED_NORMS=True"
    export TESTS=""
    ;;
  *) echo "CALL is 1 or 2"; exit 1 ;;
esac
exec bash tests/perf/gpu_hybrid2.sh
