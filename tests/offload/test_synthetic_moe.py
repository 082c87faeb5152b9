"""tests/perf/make_synthetic.py's MoE shapes: the Qwen3-30B-A3B-shaped Q4_K_M mix (sizes and
types from the plan, nothing written) and its tiny variant written, read back by gguf-py with
the expected types and metadata, and run by our engine (greedy output the same resident and
streamed from disk: the K-quant experts are used straight from their blocks)."""

import math
from types import SimpleNamespace

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import moe_blocks
from localllm.engine.moe.residency import load_model, plan_model
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.memory import MemoryInfo
from localllm.offload.residency import resolve
from tests.perf.make_synthetic import SHAPES, tensor_nbytes, tensor_plan, write_synthetic

TINY = SHAPES["tiny-qwen3moe"]


def test_30b_a3b_plan_is_a_q4_k_m_of_the_published_shape():
    s = SHAPES["qwen3moe-30b-a3b"]
    assert (s.n_layers, s.dim, s.n_heads, s.n_kv_heads, s.head_dim) == (48, 2048, 32, 4, 128)
    assert (s.n_expert, s.n_used, s.expert_ff, s.vocab) == (128, 8, 768, 151936)
    assert (s.rope_base, s.context, s.arch) == (1e6, 40960, "qwen3moe")
    plan = {name: (dims, qt) for name, dims, qt in tensor_plan(s, "Q4_K_M")}
    down = [plan[f"blk.{i}.ffn_down_exps.weight"][1] for i in range(48)]
    # llama.cpp's use_more_bits over 48 layers: 0-5, 42-47 and every third between
    more = [i for i in range(48) if i < 6 or i >= 42 or (i - 6) % 3 == 2]
    assert [i for i, q in enumerate(down) if q == QT.Q6_K] == more and len(more) == 24
    assert {q for i, q in enumerate(down) if i not in more} == {QT.Q4_K}
    assert plan["blk.7.ffn_gate_exps.weight"] == ((128, 768, 2048), QT.Q4_K)
    assert plan["blk.7.ffn_gate_inp.weight"] == ((128, 2048), QT.F32)
    assert plan["output.weight"][1] == QT.Q6_K and plan["token_embd.weight"][1] == QT.Q4_K
    total = sum(tensor_nbytes(d, q) for d, q in plan.values())
    assert 17 << 30 < total < 17.5 * (1 << 30)  # measured: 17.28 GiB
    experts = sum(math.prod(d) for n, (d, _) in plan.items() if "_exps" in n)
    assert experts == 48 * 128 * 3 * 2048 * 768


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "tiny-qwen3moe.gguf"
    total = write_synthetic(path, TINY, "Q4_K_M", None, seed=3)
    return path, total


def test_tiny_file_reads_in_gguf_py(tiny):
    path, total = tiny
    r = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in r.tensors}
    plan = tensor_plan(TINY, "Q4_K_M")
    assert types == {name: qt for name, _, qt in plan}
    assert sum(int(t.n_bytes) for t in r.tensors) == total
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert types["blk.0.ffn_down_exps.weight"] == QT.Q4_K and t.tensor_type == QT.Q6_K
    assert [int(x) for x in t.shape] == [TINY.expert_ff, TINY.dim, TINY.n_expert]  # ggml order

    def field(key):
        return r.fields[key].contents()

    assert field("general.architecture") == "qwen3moe"
    assert field("qwen3moe.expert_count") == TINY.n_expert
    assert field("qwen3moe.expert_used_count") == TINY.n_used
    assert field("qwen3moe.expert_feed_forward_length") == TINY.expert_ff
    assert field("qwen3moe.attention.key_length") == TINY.head_dim
    # gguf-py decodes the K-quant blocks to finite values
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    assert w.shape == (TINY.n_expert, TINY.dim, TINY.expert_ff) and bool((abs(w) < 1e3).all())


def test_tiny_file_runs_in_our_engine(tiny):
    path, _ = tiny
    g = open_gguf(path)
    model = build_model(g)
    a = model.args
    assert (a.n_expert, a.n_expert_used, a.expert_hidden_dim, a.head_dim) == (8, 2, 256, 64)
    assert [b.format.down for b in moe_blocks(model)] == [QT.Q4_K, QT.Q6_K]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    want = list(gen.stream([1, 2, 3, 4], params))
    assert torch.isfinite(gen.score([1, 2, 3, 4, *want])).all()
    cfg = resolve([("t", {"experts": "disk", "streaming": {"slots": 3}})])
    streamed = load_model(g, plan_model(g, cfg, 64, MemoryInfo("cpu", 1 << 30)))
    gen = Generator(g, streamed, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    assert list(gen.stream([1, 2, 3, 4], params)) == want


def test_cpu_plan_counts_prepared_bytes_only_where_the_native_kernels_do_not_run(tiny, monkeypatch):
    """The tiny Q4_K_M's experts (Q4_K / Q6_K, 256 wide) run on the native CPU kernels where
    they load: the plan then holds their file bytes alone; without the kernels (or `--precise`,
    where the exact path reads the blocks) the prepared copies are counted too."""
    import localllm.engine.moe.residency as mr
    from localllm.kernels.cpu.native import load as load_native

    path, _ = tiny
    g = open_gguf(path)
    try:
        cpu = MemoryInfo("cpu", 1 << 30)
        cfg = resolve([("t", {"experts": "host"})])
        raw = {n: t.range.nbytes for n, t in g.tensors.items() if "_exps" in n}
        native = {n: s for n, s in plan_model(g, cfg, 64, cpu).sizes.items() if n in raw}
        precise = {n: s for n, s in plan_model(g, cfg, 64, cpu, precise=True).sizes.items()
                   if n in raw}  # fmt: skip
        assert precise == raw
        if load_native() is not None:
            assert native == raw
        monkeypatch.setattr(mr, "load_native", lambda *a: None)
        torch_path = plan_model(g, cfg, 64, cpu).sizes
        assert all(torch_path[n] > raw[n] for n in raw)  # int4pack / fp16 copies beside them
    finally:
        g.close()
