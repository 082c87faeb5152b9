"""The attention output's quantized rows, written by the flash-decoding combine, feed the output
projection's dp4a GEMV: decode gives the same logits, bit for bit, with
`triton_decode.COMBINE_QUANT` on and off (eager batched decode, and CUDA-graph replay of one
sequence), and with it on no layer quantizes its attention output in a launch of its own.

GPU only (marked `gpu`): the flash-decoding kernel serves CUDA tensors alone; the kernel itself is
checked against `quantize_x8` under the interpreter in tests/kernels/test_flash_decode.py.
"""

import dataclasses

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from tests.perf.make_synthetic import SHAPES, write_synthetic

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BS = 16
TABLES = [[3, 8], [1, 6, 10], [0]]
PROMPTS = [[4, 5, 6], [7] * 20, [9, 1]]


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3moe"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("cq") / "q4km.gguf"
    shape = dataclasses.replace(SHAPES[request.param], vocab=512)
    write_synthetic(path, shape, "Q4_K_M", None, seed=2)
    gguf = open_gguf(str(path))
    yield build_model(gguf, device="cuda")
    gguf.close()


def _cache(model) -> PagedKVCache:
    layers, kvh, hd = model.kv_shape()
    return PagedKVCache(layers, 12, BS, kvh, hd, "f16", "cuda", model.kv_value_dim())


def _prefill(model, kv):
    for p, t in zip(PROMPTS, TABLES, strict=True):
        n = len(p)
        meta = BatchMeta.from_tables([n], [n], [t], BS)
        meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.cuda())
        model(torch.tensor(p, device="cuda"), torch.arange(n, device="cuda"), meta, kv)


def _batched_step(model) -> torch.Tensor:
    """Logits of one eager decode step of the three sequences (the flash kernel's plan rows)."""
    kv = _cache(model)
    _prefill(model, kv)
    pos = [len(p) for p in PROMPTS]
    meta = BatchMeta.from_tables([1, 1, 1], [n + 1 for n in pos], TABLES, BS)
    meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.cuda())
    ids, where = torch.tensor([11, 12, 13], device="cuda"), torch.tensor(pos, device="cuda")
    return model.logits(model(ids, where, meta, kv)).float()


def _replayed_step(model) -> torch.Tensor:
    """Logits of sequence 1's next token from a captured one-row decode graph."""
    from localllm.engine.runtime.cuda_graphs import DecodeGraphs, pack_decode

    kv = _cache(model)
    _prefill(model, kv)
    graphs = DecodeGraphs(model, kv)
    n, table = len(PROMPTS[1]), TABLES[1]
    row = pack_decode([12], [n], [table[n // BS] * BS + n % BS], [table]).cuda()
    got = graphs.run(row)
    assert got is not None, graphs.failed
    return got.clone()


def test_same_logits_with_and_without_the_fused_quantization(model, monkeypatch):
    from localllm.kernels.attention import triton_decode
    from localllm.kernels.quant import triton_packed

    calls = []
    plain = triton_packed.quantize_x8

    def counted(x):
        calls.append(x.shape)
        return plain(x)

    monkeypatch.setattr(triton_packed, "quantize_x8", counted)
    logits, launches = {}, {}
    with torch.inference_mode():
        for flag in (False, True):
            monkeypatch.setattr(triton_decode, "COMBINE_QUANT", flag)
            calls.clear()
            logits[flag] = _batched_step(model)
            launches[flag] = len(calls)
            logits[flag, "graph"] = _replayed_step(model)
    assert torch.equal(logits[True], logits[False])
    assert torch.equal(logits[True, "graph"], logits[False, "graph"])
    # prompts (over 4 rows) quantize nowhere; the decode step's o-proj inputs were the difference
    assert launches[False] - launches[True] == model.args.n_layers
