"""Decode graphs for large batches (issue 38: 16 to 64 streams) against eager batched decode.

`DecodeGraphs` captures one graph per batch size of its ladder; the default ladder goes to 64
rows (it stopped at 8, so a server's step of more sequences ran eagerly). With the default: B
sequences (13, 33, 64: padded up to 16, 64 and 64 rows) of different lengths over
shuffled block tables give eager batched decode's logits and write the same KV. On a CPU the
captured function runs eagerly (`DecodeGraphs.forward`); on a GPU (marked `gpu`) it is captured
and replayed, for a dense llama and a qwen3moe (routed experts at batch > 8 inside a graph).
"""

import dataclasses
import random

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.cuda_graphs import BATCH_SIZES, COLS, DecodeGraphs, pack_decode
from localllm.engine.runtime.kv_cache import PagedKVCache
from tests.perf.make_synthetic import SHAPES, write_synthetic

BS = 16


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3moe"])
def model_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("ladder") / f"{request.param}.gguf"
    shape = dataclasses.replace(SHAPES[request.param], vocab=512)
    write_synthetic(path, shape, "Q4_K_M", None, seed=2)
    return path


def _batch(path, device: str, n: int, replay: bool):
    """n sequences (prompts of 1..40 tokens, one or three blocks each) decode one token: the
    ladder's graph (or its function run eagerly) against the model's eager batched forward."""
    rng = random.Random(n)
    gguf = open_gguf(str(path))
    try:
        model = build_model(gguf, device=device)
        layers, kvh, hd = model.kv_shape()
        dtype = "f16" if device != "cpu" else "f32"
        blocks = 3 * n + 1
        order = list(range(blocks))
        rng.shuffle(order)  # non-consecutive block ids
        tables = [order[3 * i : 3 * i + rng.choice((1, 3))] for i in range(n)]
        lens = [rng.randint(1, 16 * len(t) - 1) for t in tables]
        prompts = [[rng.randrange(3, 500) for _ in range(m)] for m in lens]
        with torch.inference_mode():
            kv_e, kv_g = (
                PagedKVCache(layers, blocks, BS, kvh, hd, dtype, device, model.kv_value_dim())
                for _ in range(2)
            )
            for kv in (kv_e, kv_g):
                for p, t in zip(prompts, tables, strict=True):
                    meta = BatchMeta.from_tables([len(p)], [len(p)], [t], BS)
                    meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device))
                    ids = torch.tensor(p, device=device)
                    model(ids, torch.arange(len(p), device=device), meta, kv)
            toks = [rng.randrange(3, 500) for _ in range(n)]
            slots = [t[p // BS] * BS + p % BS for t, p in zip(tables, lens, strict=True)]
            graphs = DecodeGraphs(model, kv_g)  # the default ladder
            rows = pack_decode(toks, lens, slots, tables).to(device)
            key = graphs.key(n, rows.shape[1] - COLS)
            if replay:
                got = graphs.run(rows)
                assert got is not None and list(graphs.graphs) == [key], graphs.failed
            else:  # the captured function on the padded input (rows past n repeat row 0)
                padded = torch.cat([rows, rows[:1].expand(key[0] - n, -1)])
                width = padded.new_zeros(key[0], key[1] + COLS - rows.shape[1])
                got = graphs.forward(torch.cat([padded, width], 1))[:n]
            meta = BatchMeta.from_tables([1] * n, [p + 1 for p in lens], tables, BS)
            meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device))
            ids, where = torch.tensor(toks, device=device), torch.tensor(lens, device=device)
            ref = model.logits(model(ids, where, meta, kv_e)).float()
            tol = 2e-2 if device == "cuda" else 1e-4
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
            written = [t[q // BS] * BS + q % BS for t, m in zip(tables, lens, strict=True)
                       for q in range(m + 1)]  # fmt: skip
            for a, b in zip(kv_g.k + kv_g.v, kv_e.k + kv_e.v, strict=True):
                a, b = a.flatten(0, 1)[written].float(), b.flatten(0, 1)[written].float()
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    finally:
        gguf.close()


def test_default_ladder_takes_steps_of_up_to_64_sequences(model_file):
    gguf = open_gguf(str(model_file))
    try:
        model = build_model(gguf, device="cpu")
        layers, kvh, hd = model.kv_shape()
        kv = PagedKVCache(layers, 8, BS, kvh, hd, "f32", "cpu", model.kv_value_dim())
        graphs = DecodeGraphs(model, kv)
        assert graphs.batch_sizes == BATCH_SIZES
        # each step size pads up to the next graph; past the ladder's top the step runs eager
        got = {n: graphs.key(n, 3)[0] for n in (1, 3, 8, 9, 16, 17, 33, 64)}
        assert got == {1: 1, 3: 4, 8: 8, 9: 16, 16: 16, 17: 32, 33: 64, 64: 64}
        assert graphs.key(65, 3) is None
    finally:
        gguf.close()


@pytest.mark.parametrize("n", [13, 33])
def test_large_batch_forward_equals_eager_batch_on_cpu(model_file, n):
    _batch(model_file, "cpu", n, replay=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [13, 33, 64])
def test_large_batch_replay_equals_eager_batch(model_file, n):
    _batch(model_file, "cuda", n, replay=True)
