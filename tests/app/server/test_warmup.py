"""`localllm serve --warmup`: what start-up makes before the first request (issue 38: a request
waited 6.9 s for a prompt graph of a length not met before), on a CPU.

The plan is checked against the real lookups a step makes (`DecodeGraphs.key`, `bucket_of`):
every graph a request of any length and any batch can ask for is in it. The warm-up's own
steps are run eagerly over a real model and cache: they write the spare block and nothing a
request reads. The flag goes through the real CLI parser, and a server on a CPU starts as it
did (nothing to warm there: no line, no delay)."""

import dataclasses

import pytest
import torch

from localllm.app.cli import build_parser
from localllm.engine import LLM, SamplingParams
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.cuda_graphs import BATCH_SIZES, COLS, DecodeGraphs
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.prefill_graphs import BUCKETS, bucket_of
from localllm.engine.runtime.warmup import (
    WarmPlan,
    _warm_eager,
    engine_plan,
    plan,
    warm_engine,
    warm_requests,
    widths,
)
from tests.perf.make_synthetic import SHAPES, write_synthetic

BS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm") / "tiny.gguf"
    write_synthetic(path, dataclasses.replace(SHAPES["tiny"], vocab=512), "Q8_0", None, seed=3)
    return path


def _gpu_plan(mode="full", seqs=64, budget=512, ctx=131072):
    return plan(mode, prompts=True, decode=True, max_num_seqs=seqs, token_budget=budget,
                max_model_len=ctx, block_size=BS)  # fmt: skip


@pytest.mark.parametrize("seqs,budget,ctx", [(64, 512, 131072), (16, 2048, 8192), (5, 600, 1000)])
def test_plan_holds_every_graph_a_step_can_ask_for(tiny, seqs, budget, ctx):
    p = _gpu_plan("full", seqs, budget, ctx)
    # prompt chunks: one step's budget at most, within the context
    wanted = {bucket_of(n) for n in range(1, min(budget, ctx) + 1)} - {None}
    assert set(p.buckets) == wanted
    gguf = open_gguf(str(tiny))
    try:
        model = build_model(gguf, device="cpu")
        layers, kvh, hd = model.kv_shape()
        kv = PagedKVCache(layers, 4, BS, kvh, hd, "f32", "cpu", model.kv_value_dim())
        graphs = DecodeGraphs(model, kv)
        max_blocks = -(-ctx // BS)
        asked = {
            graphs.key(n, blocks)[:2]
            for n in range(1, seqs + 1)
            for blocks in {1, 2, 16, 17, 31, 33, 64, 65, max_blocks // 2 + 1, max_blocks}
            if blocks <= max_blocks and graphs.key(n, blocks) is not None
        }
    finally:
        gguf.close()
    assert asked <= set(p.decode)
    # and nothing a step cannot ask for: sizes past the padded max_num_seqs, wider tables
    top = next(b for b in BATCH_SIZES if b >= min(seqs, BATCH_SIZES[-1]))
    assert max(b for b, _ in p.decode) == top
    assert max(w for _, w in p.decode) == widths(max_blocks)[-1] < 2 * max_blocks
    assert len(p.decode) == len({b for b, _ in p.decode}) * len(widths(max_blocks))


def test_modes_and_devices():
    full = _gpu_plan()
    assert full.buckets == tuple(b for b in BUCKETS if b <= 512)
    assert full.head_rows[:9] == tuple(range(1, 10))
    # eager steps: within one step's limits and the pool (default: one context)
    for step in full.eager:
        assert len(step) <= 64 and sum(n for n, _ in step) <= 512, step
        assert all(n <= c <= 131072 for n, c in step) and sum(c for _, c in step) <= 131072
    # a chunk beside a decoder in each class of (tokens, first position) triton tells apart
    klass = lambda v: "one" if v == 1 else "16" if v % 16 == 0 else "other"
    chunks = {(klass(n), klass(c - n), klass(c)) for s in full.eager if len(s) == 2
              for n, c in s[1:] if n > 1}  # fmt: skip
    assert {("16", "16", "16"), ("16", "other", "other"), ("other", "16", "other"),
            ("other", "other", "16"), ("other", "one", "16")} <= chunks  # fmt: skip
    # one decoder beside a chunk at every power-of-two context the pool holds with the chunk
    # (131,072 tokens: to 65,536), and off by 5
    alone = {s[0][1] for s in full.eager if len(s) == 2 and s[0][0] == 1 and s[1] == (48, 48)}
    twos = {32 << k for k in range(12)}
    assert twos | {m + 5 for m in twos} <= alone and max(alone) < 131072
    # as many decoders as the pool holds beside the chunk: 63 at 2,048 tokens each, not 4,096
    rows = {(len(s) - 1, max(c for _, c in s[:-1])) for s in full.eager if s[-1] == (48, 48)}
    assert (63, 2048) in rows and (63, 4096) not in rows and (16, 4096) in rows
    # experts read from the host: no decoders' grid (each eager step would read them all)
    host = plan("full", prompts=False, decode=True, max_num_seqs=64, token_budget=512,
                max_model_len=131072, block_size=BS, grid=False)  # fmt: skip
    assert 0 < len(host.eager) < 20 and host.decode == full.decode
    assert len(full.decode) == len(BATCH_SIZES) * 10  # widths 16 .. 8,192 blocks at 128K tokens
    decode = _gpu_plan("decode")
    assert decode == WarmPlan(decode=full.decode)
    assert _gpu_plan("none") == WarmPlan()
    # no graphs (a CPU runner): nothing, whatever the mode
    kw = dict(max_num_seqs=64, token_budget=512, max_model_len=4096, block_size=BS)
    assert plan("full", prompts=False, decode=False, **kw) == WarmPlan()
    # a hybrid's runner: decode graphs only, no prompt buckets
    assert plan("full", prompts=False, decode=True, **kw).buckets == ()
    # a short context: no bucket longer than a chunk can be; none where chunks stay eager
    assert _gpu_plan(ctx=300).buckets[-1] == 384
    assert _gpu_plan(budget=20).buckets == ()
    with pytest.raises(ValueError, match="--warmup must be one of full, decode, none, got 'all'"):
        plan("all", prompts=True, decode=True, **kw)


def test_warm_steps_write_only_the_spare_block(tiny):
    """The eager steps and a decode graph's rows, run over a cache whose real blocks hold random
    values: those stay bitwise the same, the spare block is written."""
    gguf = open_gguf(str(tiny))
    try:
        model = build_model(gguf, device="cpu")
        layers, kvh, hd = model.kv_shape()
        blocks = 24  # 23 a request may own, the last one spare
        kv = PagedKVCache(layers, blocks, BS, kvh, hd, "f32", "cpu", model.kv_value_dim())
        gen = torch.Generator().manual_seed(0)
        for t in kv.k + kv.v:
            t.copy_(torch.randn(t.shape, generator=gen))
        before = [t.clone() for t in kv.k + kv.v]
        fields = ["model", "kv", "device", "lora"]
        runner = dataclasses.make_dataclass("R", fields)(model, kv, kv.device, None)
        p = _gpu_plan(budget=512, ctx=1024)
        with torch.inference_mode():
            _warm_eager(runner, p, blocks - 1, BS)
            graphs = DecodeGraphs(model, kv)
            rows = graphs.warm_rows(4, 32, blocks - 1, BS)
            assert rows.shape == (4, COLS + 32)
            logits = graphs.forward(rows)  # the function a capture records
        assert torch.isfinite(logits).all()
        for a, b in zip(kv.k + kv.v, before, strict=True):
            assert torch.equal(a[: blocks - 1], b[: blocks - 1])
            assert not torch.equal(a[blocks - 1], b[blocks - 1])
    finally:
        gguf.close()


def test_a_cpu_engine_warms_nothing(tiny):
    llm = LLM(str(tiny), max_model_len=512, max_num_seqs=4)
    assert engine_plan(llm.engine, "full") == WarmPlan()
    report = warm_engine(llm.engine, "full")
    assert report.captured == 0 and report.failed is None
    assert not llm.engine.has_unfinished_requests()


def test_warm_requests_leave_no_trace(tiny):
    """The real requests of a GPU's full warm-up, run on a CPU engine: they finish, and a
    client's request then gets what it gets from an engine that never ran them."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(5, 305))  # 300 tokens, as long as the warm-up's first
    fresh = LLM(str(tiny), max_model_len=512, max_num_seqs=4)
    want = fresh.generate([prompt], params)[0].outputs[0].token_ids
    llm = LLM(str(tiny), max_model_len=512, max_num_seqs=4)
    warm_requests(llm.engine)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.groups
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == want


def test_flag_parses_with_a_documented_default():
    parse = build_parser().parse_args
    assert parse(["serve"]).warmup == "full"
    assert parse(["serve", "--warmup", "decode"]).warmup == "decode"
    assert parse(["serve", "--warmup", "none"]).warmup == "none"
    with pytest.raises(SystemExit) as e:
        parse(["serve", "--warmup", "all"])
    assert e.value.code == 2
