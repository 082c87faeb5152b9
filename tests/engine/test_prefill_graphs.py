"""Prompt CUDA graphs against eager prompts.

CPU (always run): the device-context attention's reference is the block-table path with zeros
for padding rows (every cache format, windows, soft-cap, sinks); a device context is one sequence
with no host table; `PrefillGraphs.forward` (the captured function, run eagerly) over padded
inputs gives the eager chunks' hidden states and writes the same KV at their slots, and the
padding touches no slot but the spare one. GPU (marked `gpu`): replayed prompt graphs of a tiny
llama and a tiny qwen3moe (first chunks and chunks after context, an exact bucket and padded, two
block tables through the same graphs) equal eager chunks; the engine's greedy tokens after a
40-token prompt are the same with prompt graphs on and off. The kernel reading blocks through
the table: tests/kernels/test_flash_prefill.py.
"""

import dataclasses
import gc

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.prefill_graphs import BUCKETS, PrefillGraphs, bucket_of
from localllm.kernels.attention import context_attention, encode_kv, paged_attention, write_paged
from tests.engine.near_ties import assert_same_or_near_tie
from tests.perf.make_synthetic import SHAPES, write_synthetic

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BS = 16
NB = 12  # blocks in the test caches; the last one is the spare
SPARE = (NB - 1) * BS
TABLES = ([7, 2, 9, 0, 4, 8], [3, 10, 1, 5, 6])  # shuffled (non-consecutive) block tables


def _slots(table, n):
    return [table[p // BS] * BS + p % BS for p in range(n)]


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "fp8"])
@pytest.mark.parametrize("extra", [{}, {"window": 5}, {"softcap": 3.0}, {"sinks": True}])
def test_context_attention_reference_is_the_table_path_with_zero_padding(dtype, extra):
    """Off CUDA (and for 8-bit caches) the device-context path reads the context back to the
    host: the block-table path's rows, zeros for the padding rows."""
    g = torch.Generator().manual_seed(0)
    kvh, h, d, n, start, pad = 2, 4, 16, 37, 20, 11
    kc, vc = [], []
    for cache in (kc, vc):
        vals = torch.randn(n, kvh, d, generator=g)
        enc, sc = encode_kv(vals, dtype)
        cache.append(torch.zeros(NB, BS, kvh, d).to(enc.dtype))
        cache.append(None if sc is None else torch.zeros(NB, BS, *sc.shape[1:], dtype=sc.dtype))
        slots = torch.tensor(_slots(TABLES[0], n))
        write_paged(cache[0], enc, slots)
        if sc is not None:
            write_paged(cache[1], sc, slots)
    q = torch.randn(n - start + pad, h, d, generator=g)
    sinks = torch.randn(h, generator=g) if extra.get("sinks") else None
    window, softcap = extra.get("window"), extra.get("softcap")
    table = tuple(TABLES[0][: -(-n // BS)])
    ref = paged_attention(q[: n - start], kc[0], vc[0], (0, n - start), (n,), (table,), 0.25,
                          window, softcap, kc[1], vc[1], sinks=sinks)  # fmt: skip
    padded = torch.tensor(TABLES[0] + [0] * 2)
    got = context_attention(q, kc[0], vc[0], padded, torch.tensor([start, n]), 0.25, window,
                            softcap, kc[1], vc[1], sinks)  # fmt: skip
    assert torch.equal(got[: n - start], ref) and not got[n - start :].any()


def test_a_device_context_is_one_sequence_with_no_host_table():
    slots, ctx = torch.arange(4), (torch.zeros(8, dtype=torch.long), torch.tensor([0, 4]))
    BatchMeta((0, 4), (4,), ((),), slots, BS, context=ctx)  # fine: no host table needed
    with pytest.raises(ValueError, match="device context"):
        BatchMeta((0, 4), (4,), ((0,),), slots, BS, context=ctx)  # a host table as well
    with pytest.raises(ValueError, match="device context"):
        BatchMeta((0, 2, 4), (2, 2), ((), ()), slots, BS, context=ctx)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill")
    out = {}
    for name in ("tiny", "tiny-qwen3moe"):
        path = root / f"{name}.gguf"
        shape = dataclasses.replace(SHAPES[name], vocab=512)
        write_synthetic(path, shape, "Q4_K_M", None, seed=2)
        out[name] = path
    return out


def _eager(model, kv, chunk, start, table, device):
    n, end = len(chunk), start + len(chunk)
    slots = torch.tensor(_slots(table, end)[start:], device=device)
    meta = BatchMeta((0, n), (end,), (tuple(table[: -(-end // BS)]),), slots, BS)
    ids, pos = torch.tensor(chunk, device=device), torch.arange(start, end, device=device)
    return model(ids, pos, meta, kv)


def _written(kv, slots):
    return [t.flatten(0, 1)[slots].float() for t in kv.k + kv.v]


# (sequence, first position, tokens): a 32-token prompt (a bucket) then a 40-token chunk after
# it (padded to 48), a 40-token prompt on another table through the same graph, then 33 more
CHUNKS = [(0, 0, 32), (0, 32, 40), (1, 0, 40), (1, 40, 33)]


def _compare(path, device: str, replay: bool):
    """CHUNKS eagerly and through prompt graphs: (eager hidden, graph hidden, eager KV rows,
    graph KV rows) per chunk; and the spare block's other slots are untouched."""
    gguf = open_gguf(str(path))
    try:
        model = build_model(gguf, device=device)
        layers, kvh, hd = model.kv_shape()
        dtype = "f16" if device != "cpu" else "f32"

        def cache():
            kv = PagedKVCache(layers, NB, BS, kvh, hd, dtype, device, model.kv_value_dim())
            for t in kv.k + kv.v:
                t.zero_()
            return kv

        kv_e, kv_g = cache(), cache()
        prompts = PrefillGraphs(model, kv_g, SPARE, max_blocks=8)
        g = torch.Generator().manual_seed(3)
        out = []
        with torch.inference_mode():
            for seq, start, n in CHUNKS:
                table = TABLES[seq]
                chunk = torch.randint(0, 512, (n,), generator=g).tolist()
                ref = _eager(model, kv_e, chunk, start, table, device)
                ids = torch.tensor(chunk, device=device)
                s = _slots(table, start + n)[start:]
                slots = torch.tensor(s, device=device)
                if replay:
                    got = prompts.run(ids, slots, start, table)
                    assert got is not None, prompts.failed
                else:  # the captured function, run eagerly on the padded input
                    inputs = torch.zeros(3, bucket_of(n), dtype=torch.long, device=device)
                    prompts.fill(inputs, ids, slots, start, table)
                    got = prompts.forward(inputs)[:n]
                out.append((ref.float().cpu(), got.float().cpu(),
                            _written(kv_e, s), _written(kv_g, s)))  # fmt: skip
        if replay:
            assert sorted(prompts.graphs) == [32, 48]
        # the padding wrote the spare block's first slot alone
        for t in kv_g.k + kv_g.v:
            assert not t[NB - 1, 1:].any()
        return out
    finally:
        gguf.close()


def _assert_same(out, tol):
    for ref, got, kv_ref, kv_got in out:
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        for a, b in zip(kv_got, kv_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3moe"])
def test_padded_prompt_forward_equals_eager_on_cpu(models, name):
    _assert_same(_compare(models[name], "cpu", replay=False), 1e-4)


def test_buckets_cover_the_prompt_chunk():
    from localllm.engine.config import EngineArgs

    assert tuple(sorted(BUCKETS)) == BUCKETS
    assert BUCKETS[-1] >= EngineArgs().max_num_batched_tokens


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3moe"])
def test_prompt_graph_replay_equals_eager(models, name):
    _assert_same(_compare(models[name], "cuda", replay=True), 2e-2)


@pytest.mark.gpu
@gpu
def test_engine_greedy_tokens_same_with_and_without_prompt_graphs(models):
    from localllm.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(3, 43))]  # 40 tokens: padded to the 48 bucket
    out = {}
    for flag in ("0", "1"):
        llm = LLM(str(models["tiny-qwen3moe"]), max_model_len=256, device="cuda")
        graphs = llm.engine.runner.prompts
        assert graphs is not None and graphs.usable  # on by default on CUDA
        if flag == "0":
            llm.engine.runner.prompts = None  # the eager path
        out[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if flag == "1":
            assert graphs.failed is None and list(graphs.graphs) == [48]
        del llm, graphs
        gc.collect()
        torch.cuda.empty_cache()
    # padded rows change no real row's math, but the 48-row kernels may sum in another order
    assert_same_or_near_tie(models["tiny-qwen3moe"], prompts, out["0"], out["1"])
