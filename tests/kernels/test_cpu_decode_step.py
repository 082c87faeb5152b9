"""The native decode step (`kernels/cpu/decode_step.c`) against its torch reference
(`decode_step_reference`: the same layers step by step, the linears through the same native
kernels) on random block weights and a paged cache (float32 and float16, GQA, rope in pairs and
halves, SiLU and GELU, several sequences of different lengths, Gemma 3's extra norms, windows and
second rope table, Qwen2's q|k|v biases, Qwen3-MoE's routed experts, gpt-oss's sinks, biases and
MXFP4 experts, GLM's sigmoid routing, shared expert and narrower dense layer), and a real model's
decode steps as close to exact math with the step as with its torch layers."""

import dataclasses

import numpy as np
import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.generator import Generator
from localllm.engine.layers.native_decode import NativeDecode
from localllm.engine.sampling.params import SamplingParams
from localllm.kernels.cpu import block_linear, decode_step, decode_step_ref
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.linear_native import NativeLinear


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    d = tmp_path_factory.mktemp("decode-step")
    lib, blocks = decode_step.load(d), block_linear.load(d)
    if lib is None or blocks is None:
        pytest.skip("no C compiler here (the torch layers run)")
    return lib, blocks


def _lin(blocks, name, n, k, rng, split=None):
    raw = block_linear.random_blocks(QuantType[name], n, k, rng)
    pieces = [raw] if split is None else list(raw.split(split))
    return NativeLinear(pieces, QuantType[name], (n, k), blocks)


def _gemma(layers, s: decode_step.Shape, seed):
    """Gemma 3's extras on each layer: q / k norms, output norms, every other layer local
    (a window of 20, the second rope table)."""
    gen = torch.Generator().manual_seed(seed)

    def w(n):
        return 1 + 0.2 * torch.randn(n, generator=gen)

    return [dataclasses.replace(lay, q_norm=w(s.head_dim), k_norm=w(s.head_dim),
                                post_attn_norm=w(s.dim), post_ffn_norm=w(s.dim),
                                window=20 * (i % 2), rope_set=i % 2)
            for i, lay in enumerate(layers)]  # fmt: skip


def _biased(layers, s: decode_step.Shape, seed):
    """Qwen2's q|k|v biases on each layer (large enough to move every head)."""
    gen = torch.Generator().manual_seed(seed)
    n = (s.n_q + 2 * s.n_kv) * s.head_dim
    return [dataclasses.replace(lay, qkv_bias=torch.randn(n, generator=gen)) for lay in layers]


def _moe(layers, s: decode_step.Shape, seed, types=("Q4_K", "Q4_K", "Q6_K")):
    """Qwen3-MoE's routed experts in place of each layer's MLP: 8 experts of s.hidden / 2, two a
    token (a router scaled so no two experts' logits nearly tie)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    n, ff = 8, s.hidden // 2

    def experts(name, rows, k):
        return block_linear.random_blocks(QuantType[name], n * rows, k, rng).view(n, rows, -1)

    return [dataclasses.replace(
        lay, router=torch.randn(n, s.dim, generator=gen) * 0.3, n_used=2,
        experts=(experts(types[0], ff, s.dim), experts(types[1], ff, s.dim),
                 experts(types[2], s.dim, ff)),
        exp_types=tuple(QuantType[t] for t in types)) for lay in layers]  # fmt: skip


def _gpt_oss(layers, s: decode_step.Shape, seed):
    """gpt-oss's layers: q|k|v and output biases, attention sinks, every other layer a window of
    20, MXFP4 experts with biases and the clamped SwiGLU (gate / up values past its limit of 7
    occur), a biased router."""
    layers = _biased(_moe(layers, s, seed, ("MXFP4",) * 3), s, seed + 1)
    gen = torch.Generator().manual_seed(seed)
    n, ff = 8, s.hidden // 2

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return [dataclasses.replace(
        lay, o_bias=r(s.dim), sinks=r(s.n_q, scale=2.0), window=20 * (i % 2),
        router_bias=r(n, scale=0.5), exp_act="swiglu_oai",
        exp_bias=(r(n, ff, scale=4.0), r(n, ff, scale=4.0), r(n, s.dim)))
        for i, lay in enumerate(layers)]  # fmt: skip


def _glm(blocks, layers, s: decode_step.Shape, seed):
    """GLM-4.5-Air's layers: the first dense and narrower than the step's hidden (384 of 512),
    the second routed by sigmoid scores with a choice bias (large enough to change the choice)
    and a weight scale (0.025: the random experts' outputs would drown the shared expert's),
    plus a shared expert of 128."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    dense = dataclasses.replace(
        layers[0], hidden=384, gate_up=[_lin(blocks, "Q5_1", 768, s.dim, rng, [384, 384])],
        down=_lin(blocks, "IQ4_NL", s.dim, 384, rng))  # fmt: skip
    moe = _moe(layers[1:2], s, seed, ("Q8_0",) * 3)[0]
    moe = dataclasses.replace(
        moe, scoring="sigmoid", probs_bias=torch.randn(8, generator=gen) * 0.5, w_scale=0.025,
        shared_gu=[_lin(blocks, "Q8_0", 256, s.dim, rng, [128, 128])],
        shared_down=_lin(blocks, "Q8_0", s.dim, 128, rng))  # fmt: skip
    return [dense, moe]


def _layers(blocks, s: decode_step.Shape, n_layers, n_blocks, bsz, dtype, seed):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    hd, nq, nkv = s.head_dim, s.n_q, s.n_kv
    out = []
    for _ in range(n_layers):
        qk = _lin(blocks, "Q4_0", (nq + nkv) * hd, s.dim, rng, [nq * hd, nkv * hd])
        v = _lin(blocks, "Q6_K", nkv * hd, s.dim, rng)
        gu = _lin(blocks, "Q5_1", 2 * s.hidden, s.dim, rng, [s.hidden, s.hidden])
        kc = (torch.randn(n_blocks, bsz, nkv, hd, generator=gen) * 0.5).to(dtype)
        vc = torch.randn(n_blocks, bsz, nkv, hd, generator=gen).to(dtype)
        an, fn = (1 + 0.1 * torch.randn(s.dim, generator=gen) for _ in range(2))
        o = _lin(blocks, "Q8_0", s.dim, nq * hd, rng)
        down = _lin(blocks, "IQ4_NL", s.dim, s.hidden, rng)
        out.append(decode_step.LayerSpec([qk, v], o, [gu], down, an, fn, kc, vc))
    return out


@pytest.mark.parametrize(("dtype", "neox", "act", "lens", "n_kv", "threads", "extras"), [
    (torch.float32, False, "silu", [37], 2, 2, None),
    (torch.float16, True, "gelu", [5, 61, 16], 2, 1, None),
    (torch.float32, False, "silu", [1, 33], 2, 2, None),
    (torch.float16, False, "silu", [40], 1, 2, None),  # one KV head: query heads in two pieces
    (torch.float32, False, "silu", [40], 1, 3, None),  # (three threads: four pieces)
    (torch.float32, True, "gelu", [7, 45, 64], 1, 2, "gemma"),  # Gemma 3's layers
    (torch.float16, True, "silu", [9, 50], 2, 2, "bias"),  # Qwen2's q|k|v biases
    (torch.float32, True, "silu", [13, 40, 3], 2, 2, "moe"),  # Qwen3-MoE's routed experts
    (torch.float16, True, "silu", [30, 7, 19, 2, 11], 2, 3, "moe-q8"),  # (experts shared by rows)
    (torch.float32, True, "silu", [13, 40, 3, 27], 2, 2, "gpt-oss"),  # sinks, biases, MXFP4
    (torch.float16, True, "silu", [21, 6, 33], 2, 2, "glm"),  # sigmoid routing, shared expert
])  # fmt: skip
def test_step_matches_the_torch_reference(parts, dtype, neox, act, lens, n_kv, threads, extras):
    lib, blocks = parts
    gemma = extras == "gemma"
    scale = 0.07 if gemma else None
    s = decode_step.Shape(256, 8, n_kv, 64, 512, 64 if not neox else 32, neox, 1e-5, act, scale)
    bsz, t = 16, len(lens)
    tables = torch.tensor([[4 * i + 3, 4 * i + 1, 4 * i + 2, 4 * i] for i in range(t)])
    layers = _layers(blocks, s, 2, 4 * t, bsz, dtype, len(lens))
    layers = _gemma(layers, s, 1) if gemma else layers
    layers = _biased(layers, s, 2) if extras == "bias" else layers
    layers = _moe(layers, s, 4) if extras == "moe" else layers
    layers = _moe(layers, s, 5, ("Q8_0",) * 3) if extras == "moe-q8" else layers
    layers = _gpt_oss(layers, s, 6) if extras == "gpt-oss" else layers
    layers = _glm(blocks, layers, s, 7) if extras == "glm" else layers
    ref_layers = [dataclasses.replace(lay, k_cache=lay.k_cache.clone(),
                                      v_cache=lay.v_cache.clone()) for lay in layers]  # fmt: skip
    seq_lens = torch.tensor(lens)
    pos = seq_lens - 1
    slots = tables[torch.arange(t), pos // bsz] * bsz + pos % bsz
    angles = pos[:, None].float() * 10000 ** (-torch.arange(0, s.rope_dims, 2) / s.rope_dims)
    cos, sin = angles.cos(), angles.sin()
    cos1, sin1 = (angles * 0.3).cos(), (angles * 0.3).sin()  # (only layers with rope_set 1)
    x = torch.randn(t, s.dim, generator=torch.Generator().manual_seed(3))
    want = decode_step_ref.decode_step_reference(s, ref_layers, bsz, x, cos, sin, slots, seq_lens,
                                             tables, cos1, sin1)  # fmt: skip
    step = decode_step.DecodeStep(lib, s, layers, bsz)
    got = step(x.clone(), cos, sin, slots, seq_lens, tables, threads, cos1, sin1)
    rows = (got - want).norm(dim=-1) / want.norm(dim=-1)
    # Both quantize activations to int8: where the two sum in other orders, a code of a value
    # near a rounding edge may round apart and move its row (which rows, depends on the CPU's
    # math libraries: "moe-q8" rows 0 and 1 by 0.4 % and 0.9 % on an Intel Xeon with AVX-512,
    # none on a Zen 5); the rows that round alike agree to float rounding (~1e-7)
    assert (rows < 2e-2).all(), rows
    assert (rows < 1e-5).sum() * 2 >= len(rows), rows
    apart = slots[rows >= 1e-5]  # (past the first layer their K and V carry the difference)
    for i, (a, b) in enumerate(zip(layers, ref_layers, strict=True)):  # new K and V written
        for mine, ref in ((a.k_cache, b.k_cache), (a.v_cache, b.v_cache)):
            mine, ref = mine.float().flatten(0, 1), ref.float().flatten(0, 1)
            if i:
                mine[apart], ref[apart] = 0, 0
            assert torch.allclose(mine, ref, rtol=1e-2, atol=1e-2), i


def test_bad_layouts_are_refused(parts):
    lib, blocks = parts
    s = decode_step.Shape(256, 8, 3, 64, 512, 64, False, 1e-5)  # 8 query heads over 3 KV heads
    layers = _layers(blocks, decode_step.Shape(256, 8, 2, 64, 512, 64, False, 1e-5), 1, 2, 16,
                     torch.float32, 0)  # fmt: skip
    with pytest.raises(ValueError, match="no native decode step"):
        decode_step.DecodeStep(lib, s, layers, 16)
    q8 = [dataclasses.replace(lay, k_cache=lay.k_cache.to(torch.bfloat16)) for lay in layers]
    with pytest.raises(ValueError, match="float32 or float16"):
        decode_step.DecodeStep(lib, decode_step.Shape(256, 8, 2, 64, 512, 64, False, 1e-5), q8, 16)
    short = [dataclasses.replace(lay, qkv_bias=torch.zeros(8 * 64)) for lay in layers]  # q's only
    with pytest.raises(ValueError, match="q\\|k\\|v bias"):
        decode_step.DecodeStep(lib, decode_step.Shape(256, 8, 2, 64, 512, 64, False, 1e-5), short,
                               16)  # fmt: skip


def _decode_logits(gen: Generator, tokens: list[int], n_prompt: int) -> torch.Tensor:
    """Logits of decode steps teacher-forced on `tokens` after a prompt of n_prompt of them."""
    m, kv = gen.model, gen._cache(len(tokens) + 16)
    out = []
    with torch.inference_mode():
        m(torch.tensor(tokens[:n_prompt]), torch.arange(n_prompt),
          BatchMeta.contiguous(n_prompt, n_prompt, kv.block_size), kv)  # fmt: skip
        for p in range(n_prompt, len(tokens)):
            table = tuple(range(p // kv.block_size + 1))
            batch = BatchMeta((0, 1), (p + 1,), (table,), torch.tensor([p]), kv.block_size)
            out.append(m.logits(m(torch.tensor([tokens[p]]), torch.tensor([p]), batch, kv))[0])
    return torch.stack(out).double()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


@pytest.fixture(scope="module")
def qwen3moe_q8_path(tmp_path_factory):
    """A tiny qwen3moe whose attention linears and experts are Q8_0: its steps qualify."""
    from gguf import GGMLQuantizationType as QT

    from tests.offload.tiny_moe import MoESpec, write_moe_gguf

    spec = MoESpec(expert_qtype=QT.Q8_0, attn_qtype=QT.Q8_0)
    return write_moe_gguf(tmp_path_factory.mktemp("moe-step") / "moe.gguf", spec)


@pytest.fixture(scope="module")
def mixtral_q8_path(tmp_path_factory):
    """The same as a Mixtral-style llama MoE (no q/k norms, its own rope base)."""
    from gguf import GGMLQuantizationType as QT

    from tests.offload.tiny_moe import MIXTRAL, write_moe_gguf

    spec = dataclasses.replace(MIXTRAL, expert_qtype=QT.Q8_0, attn_qtype=QT.Q8_0)
    return write_moe_gguf(tmp_path_factory.mktemp("moe-step") / "mixtral.gguf", spec)


@pytest.mark.parametrize(
    "model", ["smollm2_path", "gemma3_path", "qwen3moe_q8_path", "mixtral_q8_path"]
)
def test_a_real_model_decodes_as_close_to_exact_math_natively(request, model):
    """Teacher-forced decode steps of the native step and of the torch layers with the same
    int8-activation linears (other roundings elsewhere) against the precise model: the step is
    no further from it. (By default the torch layers multiply Q4_1 and the like exactly.)"""
    path = str(request.getfixturevalue(model))
    gen = Generator.load(path)
    exact = Generator.load(path, precise=True)
    try:
        prompt = gen.tokenizer.encode("The capital of France is", add_special=False)
        p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        tokens = prompt + list(gen.stream(prompt, p))
        native = _decode_logits(gen, tokens, len(prompt))
        assert isinstance(gen.model._native_step, NativeDecode)  # the step ran
        gen.model._native_step = False  # the torch layers, on int8 activations like the step
        for m in gen.model.modules():
            for k in m.kernels() if hasattr(m, "kernels") and callable(m.kernels) else ():
                if isinstance(k, NativeLinear):
                    k.int8_max_t = 64
        eager = _decode_logits(gen, tokens, len(prompt))
        want = _decode_logits(exact, tokens, len(prompt))
    finally:
        gen.close()
        exact.close()
    kl_native, kl_eager = _kl(want, native), _kl(want, eager)
    print(
        f"{model}: mean KL to exact math: native step {kl_native:.5f}, torch layers {kl_eager:.5f}"
    )
    assert kl_native < 1.5 * kl_eager + 1e-4, (kl_native, kl_eager)
    top = want.argmax(-1)
    agree_native = (native.argmax(-1) == top).float().mean().item()
    agree_eager = (eager.argmax(-1) == top).float().mean().item()
    assert agree_native >= agree_eager - 2 / len(top), (agree_native, agree_eager)


def test_drawn_routing_leaves_the_step(qwen3moe_q8_path):
    """A measurement's drawn experts (`bench --routing`) are the torch layers' to apply."""
    gen = Generator.load(str(qwen3moe_q8_path))
    try:
        step = NativeDecode.for_model(gen.model)
        assert step is not None  # resident Q8_0 experts, the plain router: the step takes them
        kv = gen._cache(64)
        one = BatchMeta((0, 1), (5,), ((0,),), torch.tensor([4]), kv.block_size)
        stats = {id(s): s for s in (b.mlp.source.stats for b in gen.model.blk)}.values()
        before = sum(s.lookups for s in stats)
        assert step(torch.tensor([3]), torch.tensor([4]), one, kv) is not None
        # each layer's distinct experts counted as the torch layers count them: k of one row
        assert sum(s.lookups for s in stats) - before == sum(b.mlp.n_used for b in gen.model.blk)
        gen.model.blk[1].mlp.routing_override = object()
        assert step(torch.tensor([3]), torch.tensor([4]), one, kv) is None
    finally:
        gen.close()


def test_steps_it_cannot_take_fall_back(smollm2_path):
    gen = Generator.load(str(smollm2_path))
    try:
        step = NativeDecode.for_model(gen.model)
        assert step is not None
        kv = gen._cache(64)
        two = BatchMeta.contiguous(2, 2, kv.block_size)  # a prompt of two tokens: one sequence
        assert step(torch.tensor([1, 2]), torch.arange(2), two, kv) is None
        kv8 = type(kv)(*gen.model.kv_shape()[:1], 4, 16, *gen.model.kv_shape()[1:], dtype="q8_0")
        one = BatchMeta.contiguous(1, 1, 16)
        assert step(torch.tensor([1]), torch.arange(1), one, kv8) is None  # 8-bit cache
    finally:
        gen.close()
