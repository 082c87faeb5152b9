"""lfm2 and granitehybrid on CUDA (marked `gpu`): the recurrent state in device slots, the scans'
CUDA path, attention's CUDA kernels with f16 KV; logits near transformers' fp32 goldens whole
and in chunks, greedy tokens equal up to a near-tie through the engine, a batch of four equal to
each alone, n = 2 forks equal alone, preempted requests resuming to the same tokens, and
Granite's experts from disk or the host giving the resident run's tokens.
"""

import dataclasses
import itertools

import pytest
import torch

from localllm.engine import LLM, SamplingParams
from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states
from tests.engine.family_goldens import assert_greedy_matches, golden, golden_logits, path
from tests.engine.near_ties import assert_same_or_near_tie

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NAMES = ["lfm2", "lfm2moe", "granitehybrid", "granitehybrid_dense"]
# default CUDA kernels, f16 KV, against fp32. Wider than the KV-only families' 0.02: Granite's
# scales and the SSM's exponentials amplify activations rounded to half precision (the CPU's
# default kernels, whose few-row GEMVs round them to f16, are 0.15 off on its decode rows)
GPU_TOL = 0.25
NEAR_TIE = 0.05
BLOCK = 16


@torch.inference_mode()
def _chunked_logits(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    layers, kv_heads, head_dim = model.kv_shape()
    kv = PagedKVCache(layers, -(-len(ids) // BLOCK), BLOCK, kv_heads, head_dim, "f16", "cuda")
    attach_states(kv, model, 1)
    bounds = [0, *itertools.accumulate(chunks)]
    bounds = [b for b in bounds if b < len(ids)] + [len(ids)]
    rows = []
    for s, e in itertools.pairwise(bounds):
        ids_t = torch.tensor(ids[s:e], device="cuda")
        batch = BatchMeta.contiguous(e - s, e, BLOCK)
        batch = dataclasses.replace(batch, slot_mapping=batch.slot_mapping.to("cuda"))
        rows.append(model.logits(model(ids_t, torch.arange(s, e, device="cuda"), batch, kv)))
    return torch.cat(rows).float().cpu()


@pytest.mark.parametrize("name", NAMES)
def test_gpu_logits_near_transformers_whole_and_chunked(name):
    g = golden(name)
    ids = g["prompt"]["ids"] + g["greedy_ids"]
    with open_gguf(path(name)) as f:
        model = build_model(f, device="cuda")
        for chunks in ([len(ids)], [7, 5, *[1] * 40]):
            err = (_chunked_logits(model, ids, chunks) - golden_logits(name)).abs().max().item()
            assert err < GPU_TOL, (name, chunks[:3], err)


def _llm(name, **kw):
    return LLM(str(path(name)), device="cuda", max_model_len=256, block_size=BLOCK, **kw)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("name", NAMES)
def test_gpu_engine_greedy_batch_forks_and_preemption(name):
    prompt = golden(name)["prompt"]["ids"]
    prompts = [prompt, prompt[::-1], prompt[3:25], prompt[10:]]
    n = len(golden(name)["greedy_ids"])
    with _llm(name, max_num_batched_tokens=8) as llm:
        together = _tokens(llm.generate(prompts, _greedy(n)))
        alone = [_tokens(llm.generate([p], _greedy(n)))[0] for p in prompts]
        forks = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, n=2,
                                                      ignore_eos=True))[0]  # fmt: skip
        per_block = llm.engine.kv_plan.bytes_per_block
    assert_greedy_matches(name, together[0], NEAR_TIE)
    # the device's kernels differ with the batch's rows (GEMV against GEMM): equal, or parted at
    # a near-tie of the precise CPU reference
    assert_same_or_near_tie(path(name), prompts, together, alone)
    fork_tokens = [list(c.token_ids) for c in forks.outputs]
    assert_same_or_near_tie(path(name), [prompt] * 2, fork_tokens, [alone[0]] * 2)
    # 7 blocks of 16 for four sequences growing past 48 tokens: some are preempted, give back
    # their state slots and recompute their state when they resume
    with _llm(name) as llm:
        alone = [_tokens(llm.generate([p], _greedy(20)))[0] for p in prompts]
    with _llm(name, kv_cache_memory=7 * per_block) as small:
        got = _tokens(small.generate(prompts, _greedy(20)))
        assert small.engine.scheduler.num_preemptions > 0
    assert_same_or_near_tie(path(name), prompts, got, alone)


@pytest.mark.parametrize(
    "layer", [{"experts": "disk", "streaming": {"slots": 2}}, {"cpu_moe": True}]
)
def test_gpu_granite_experts_off_device_match_resident(layer):
    from localllm.offload.residency import resolve

    prompt = golden("granitehybrid")["prompt"]["ids"]
    runs = []
    for residency in (None, resolve([("test", layer)])):
        with _llm("granitehybrid", residency=residency) as llm:
            runs.append(_tokens(llm.generate([prompt], _greedy(12)))[0])
    assert runs[0] == runs[1]
