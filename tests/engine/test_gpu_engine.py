"""The engine on CUDA against the CPU path: end-to-end greedy tokens (marked `gpu`).

Reference: the CPU engine in precise mode (float32 matmuls and KV). The GPU run uses its default
kernels (triton GEMV in float32 for decode, bf16 GEMM for prefill, f16 KV), so tokens must be
equal up to a near-tie: wherever the two first differ, the reference's logits for the two
choices must be within NEAR_TIE of each other at that position.
"""

import dataclasses

import pytest
import torch

from localllm.engine import LLM, SamplingParams
from localllm.engine.generator import Generator
from tests.perf.make_synthetic import SHAPES, write_synthetic

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NEAR_TIE = 0.05  # logits (reference) of the two tokens at the first difference
N_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_models")
    out = {}
    shape = dataclasses.replace(SHAPES["tiny"], vocab=512)
    for quant in ("Q4_K_M", "Q8_0"):
        write_synthetic(d / f"{quant}.gguf", shape, quant, None, seed=1)  # byte-level tokenizer
        out[f"llama-{quant}"] = d / f"{quant}.gguf"
    return out


def _greedy(path, prompts, **kw) -> list[list[int]]:
    llm = LLM(str(path), max_model_len=256, **kw)
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _check_near_ties(path, prompts, ref, got) -> None:
    gen = Generator.load(str(path), precise=True)
    try:
        for p, r, g in zip(prompts, ref, got, strict=True):
            i = next((j for j, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), None)
            if i is None:
                continue
            logits = gen.score(p + r[:i])[-1]
            gap = (logits[r[i]] - logits[g[i]]).item()
            assert 0 <= gap < NEAR_TIE, f"{path.name}: step {i} differs by {gap:.4f} (not a tie)"
    finally:
        gen.close()


@pytest.mark.parametrize("name", ["llama-Q4_K_M", "llama-Q8_0"])
def test_gpu_greedy_equals_cpu(models, name):
    path = models[name]
    # a short prompt (GEMV prefill), a long one (bf16 GEMM prefill) and a batch of both
    prompts = [[5, 17, 33], list(range(3, 3 + 40))]
    ref = _greedy(path, prompts, precise=True, kv_cache_dtype="f32")
    got = _greedy(path, prompts, device="cuda")
    assert all(len(g) == N_TOKENS for g in got)
    if got != ref:
        _check_near_ties(path, prompts, ref, got)


def test_gpu_engine_state_lives_on_the_device(models):
    llm = LLM(str(models["llama-Q4_K_M"]), max_model_len=256, device="cuda")
    eng = llm.engine
    assert all(t.device.type == "cuda" for t in eng.kv_cache.k + eng.kv_cache.v)
    kinds = {k.kind for m in eng.model.modules() if hasattr(m, "kernels") for k in m.kernels()}
    assert kinds == {"triton"}
    free, _ = torch.cuda.mem_get_info()
    assert eng.kv_plan.nbytes <= free + eng.kv_cache.nbytes


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_models_gpu_greedy_equals_cpu(which, request):
    path = request.getfixturevalue(f"{which}_path")
    llm = LLM(str(path), max_model_len=512)
    # the third (> 48 tokens) replays a prompt CUDA graph on the GPU, padded to its bucket
    story = " ".join(
        ["The river ran past the old mill, where the miller counted sacks of flour."] * 5
    )
    texts = ["The capital of France is", "def f(x):", story]
    prompts = [llm.engine.tokenize(t) for t in texts]
    assert len(prompts[2]) > 48
    ref = _greedy(path, prompts, precise=True, kv_cache_dtype="f32")
    got = _greedy(path, prompts, device="cuda")
    if got != ref:
        _check_near_ties(path, prompts, ref, got)


@pytest.mark.parametrize("load_mode", ["mmap", "read"])
def test_gpu_load_holds_no_raw_copy_beside_the_kernels_layout(tmp_path, load_mode):
    """Linears whose GPU kernel re-lays their blocks out are uploaded one at a time for it: the
    load's peak is what it keeps plus a weight or two in flight, not every raw upload beside
    its kernel copy (they were all held until the end of the load, twice the weights at once;
    read mode held them so after mmap mode no longer did: its private copies wait on the host)."""
    from tests.engine.load_memory import measured_load

    shape = dataclasses.replace(SHAPES["tiny"], n_layers=8, vocab=512)
    write_synthetic(tmp_path / "m.gguf", shape, "Q4_K_M", None, seed=1)
    model, file_bytes, kept, peak = measured_load(tmp_path / "m.gguf", load_mode)
    assert model is not None and kept < 1.5 * file_bytes, (kept, file_bytes)
    assert peak - kept < file_bytes // 4, (peak, kept, file_bytes)
