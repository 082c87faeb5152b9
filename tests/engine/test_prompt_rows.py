"""Prompt rows on one path (issue 39): a prompt token's logits and KV do not depend on how its
prompt was chunked or whether its head came from the prefix cache, with the int16 prompt GEMM
(`linear_native.PROMPT_I16`) as with the exact one. Before, a tail recomputed after a prefix-cache
hit took other math than the same rows inside a longer chunk: torch's chunk attention (SDPA's
blocks follow the call's query count, ~1e-7), the int8 rows of calls of <= 64 rows on Q4_K /
Q6_K / Q8_0 and the native decode step for a one-row tail; with int16 activations such
differences grew to 2e-3 in the hidden state and a server test's two answers of one prompt
split (tests/app/server/test_chat_continue.py). Now `BatchMeta.prompt` marks prompt rows, which
take the prompt GEMM whatever their count and never the native step, and CPU prompt rows attend
through `kernels.cpu.prompt_attention`, whose rows' bits do not depend on the chunk."""

import dataclasses
import itertools

import pytest
import torch

from localllm.engine import LLM, SamplingParams
from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.layers.native_decode import split_step
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.attention import paged
from localllm.kernels.cpu import block_linear
from localllm.kernels.quant import QuantType, linear_native
from localllm.kernels.quant.linear_native import NativeLinear, prompt_rows
from tests.perf.make_synthetic import SHAPES, write_synthetic

BS = 16


@pytest.fixture(params=[False, True], ids=["exact", "int16"])
def prompt_i16(request):
    """`PROMPT_I16` as weights are prepared (read in `NativeLinear.__init__`)."""
    old = linear_native.PROMPT_I16
    linear_native.PROMPT_I16 = request.param
    yield request.param
    linear_native.PROMPT_I16 = old


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A Q4_K_M random-weight llama (the native decode step; Q4_K / Q6_K take int8 rows up to
    64 rows). (MoE models are not covered: their CPU expert FFN and router still give a row
    other bits in a call of other rows, ~5e-7.)"""
    path = tmp_path_factory.mktemp("prompt-rows") / "tiny.gguf"
    write_synthetic(path, dataclasses.replace(SHAPES["tiny"], vocab=512), "Q4_K_M", None, seed=3)
    return path


def _prefill(model, ids: list[int], cuts: list[int]):
    """The prompt in chunks [cuts[i], cuts[i + 1]): hidden states [T, dim] and the cache."""
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, -(-len(ids) // BS) + 1, BS, kvh, hd, "f32", "cpu",
                      model.kv_value_dim())  # fmt: skip
    out = []
    for a, b in itertools.pairwise(cuts):
        batch = BatchMeta.contiguous(b - a, b, BS, prompt=True)
        with prompt_rows(batch.prompt_mask()):
            out.append(model(torch.tensor(ids[a:b]), torch.arange(a, b), batch, kv))
    return torch.cat(out), kv


def _same_prompt_bits(path, ids: list[int]) -> None:
    gguf = open_gguf(str(path))
    try:
        model = build_model(gguf, device="cpu")
        t = len(ids)
        with torch.inference_mode():
            want, kv0 = _prefill(model, ids, [0, t])
            for cuts in ([0, t - 1, t], [0, t - 2, t], [0, 32, t], [0, 5, 37, t - 1, t]):
                got, kv = _prefill(model, ids, cuts)
                assert torch.equal(got, want), (cuts, (got - want).abs().max().item())
                for a, b in zip(kv.k + kv.v, kv0.k + kv0.v, strict=True):
                    assert torch.equal(a.flatten(0, 1)[:t], b.flatten(0, 1)[:t]), cuts
    finally:
        gguf.close()


def test_prompt_bits_do_not_depend_on_chunks_synthetic(synthetic, prompt_i16):
    _same_prompt_bits(synthetic, [(7 * i + 3) % 500 + 3 for i in range(50)])


def test_prompt_bits_do_not_depend_on_chunks_smollm2(smollm2_path, prompt_i16):
    _same_prompt_bits(smollm2_path, [(37 * i + 11) % 40000 + 100 for i in range(50)])


def test_a_prefix_cache_hit_answers_as_the_first_request(smollm2_path, prompt_i16):
    """The server test's case in the engine: the same prompt twice, the second's head from the
    prefix cache and its tail (2 rows here; 1 row for a 49-token prompt) recomputed: the same
    logprobs to the bit, the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    with LLM(str(smollm2_path)) as llm:
        for n, m in ((50, 37), (49, 41)):  # (two prompts with no common head)
            prompt = [(m * i + 11) % 40000 + 100 for i in range(n)]
            first, second = (llm.generate([prompt], params)[0].outputs[0] for _ in range(2))
            assert llm.engine.kv_manager.stats.hits >= 32
            assert second.token_ids == first.token_ids
            for a, b in zip(first.logprobs, second.logprobs, strict=True):
                assert {k: v.logprob for k, v in a.items()} == {k: v.logprob for k, v in b.items()}


@pytest.mark.parametrize("native_step", [True, False], ids=["split", "torch-layers"])
def test_a_mixed_step_gives_each_row_its_own_path(synthetic, prompt_i16, native_step):
    """One step with a decode row of sequence 0 and a prompt chunk of sequence 1 (through
    `split_step`, or with the native step off through the torch layers, whose linears split the
    rows by `prompt_mask`): each row's bits as in a step of its own kind alone."""
    gguf = open_gguf(str(synthetic))
    try:
        model = build_model(gguf, device="cpu")
        if not native_step:
            model._native_step = False  # (as for a family the step does not know)
        layers, kvh, hd = model.kv_shape()
        a = [(5 * i + 1) % 500 + 3 for i in range(20)]
        b = [(11 * i + 2) % 500 + 3 for i in range(30)]
        tables = [(0, 1), (2, 3)]
        outs = []
        with torch.inference_mode():
            for mixed in (False, True):
                kv = PagedKVCache(layers, 4, BS, kvh, hd, "f32", "cpu", model.kv_value_dim())
                pre = BatchMeta.from_tables([19], [19], [tables[0]], BS)
                pre = dataclasses.replace(pre, prompt=(True,))
                with prompt_rows(True):
                    model(torch.tensor(a[:19]), torch.arange(19), pre, kv)
                dec = BatchMeta.from_tables([1], [20], [tables[0]], BS)
                chunk = dataclasses.replace(BatchMeta.from_tables([30], [30], [tables[1]], BS),
                                            prompt=(True,))  # fmt: skip
                if mixed:
                    both = dataclasses.replace(
                        BatchMeta.from_tables([1, 30], [20, 30], tables, BS), prompt=(False, True)
                    )
                    ids = torch.tensor([a[19], *b])
                    pos = torch.tensor([19, *range(30)])
                    with prompt_rows(both.prompt_mask()):
                        h = model(ids, pos, both, kv)
                    outs.append((h[:1], h[1:], kv))
                else:
                    h0 = model(torch.tensor(a[19:]), torch.tensor([19]), dec, kv)
                    with prompt_rows(True):
                        h1 = model(torch.tensor(b), torch.arange(30), chunk, kv)
                    outs.append((h0, h1, kv))
        (d0, p0, kv0), (d1, p1, kv1) = outs
        assert torch.equal(d1, d0), (d1 - d0).abs().max().item()
        assert torch.equal(p1, p0), (p1 - p0).abs().max().item()
        written = [*range(20), *range(32, 62)]  # the slots of both sequences' tokens
        for x, y in zip(kv1.k + kv1.v, kv0.k + kv0.v, strict=True):
            assert torch.equal(x.flatten(0, 1)[written], y.flatten(0, 1)[written])
    finally:
        gguf.close()


@pytest.mark.parametrize("name", ["Q4_K", "Q4_1", "Q6_K"])
def test_native_linear_prompt_rows_take_the_gemm_at_any_count(name, prompt_i16):
    """Inside `prompt_rows`, one row or a few give the long call's bits; a mask sends its rows
    to the GEMM and the others to the decode path, each as in a call of its own."""
    kernels = block_linear.load()
    if kernels is None:
        pytest.skip("no C compiler here")
    import numpy as np

    n, k = 96, 512
    raw = block_linear.random_blocks(QuantType[name], n, k, np.random.default_rng(1))
    lin = NativeLinear([raw], QuantType[name], (n, k), kernels)
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(2))
    with prompt_rows(True):
        full = lin.matmul(x)
        for t in (1, 2, 7):
            assert torch.equal(lin.matmul(x[-t:]), full[-t:]), t
    decode = lin.matmul(x[:3])  # the row-count rule outside: int8 rows
    assert not torch.equal(decode, full[:3])
    mask = torch.zeros(80, dtype=torch.bool)
    mask[3:] = True
    with prompt_rows(mask):
        mixed = lin.matmul(x)
    assert torch.equal(mixed[3:], full[3:]) and torch.equal(mixed[:3], decode)


@pytest.mark.parametrize("window", [None, 9])
def test_cpu_chunk_attention_rows_do_not_depend_on_the_chunk(window):
    """A chunk's prompt rows over the paged cache: each row's bits as in any other split of the
    chunk, a one-row tail too (`kernels.cpu.prompt_attention`), close to the torch reference."""
    if not paged.paged_decode.supports(*(torch.zeros(1, 4, 2, 16) for _ in range(3))):
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(4)
    heads, kvh, hd, n = 8, 2, 32, 45
    k, v = (torch.randn(4, BS, kvh, hd, generator=gen) for _ in range(2))
    q = torch.randn(n, heads, hd, generator=gen)
    table = [(2, 0, 3)]

    def attend(a, b):
        return paged.paged_attention(q[a:b], k, v, (0, b - a), (b,), table, hd**-0.5, window,
                                     prompt=(True,))  # fmt: skip

    whole = attend(0, n)
    for a in (n - 1, n - 2, 17, 32):
        assert torch.equal(attend(a, n), whole[a:]), a
    keys, vals = (c[list(table[0])].flatten(0, 1)[:n] for c in (k, v))
    ref = paged.chunk_dense(q, keys, vals, 0, hd**-0.5, window, None)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)


def test_split_step_keeps_a_one_row_prompt_tail_off_the_native_step():
    # sequence 0 decodes (row 0), sequence 1 recomputes its prompt's last token (row 1)
    batch = BatchMeta((0, 1, 2), (9, 33), ((0,), (1, 2, 3)), torch.tensor([8, 48]), 16,
                      prompt=(False, True))  # fmt: skip
    drows, dec, rrows, rest = split_step(batch, _NoLora())
    assert drows == [0] and dec.prompt == (False,)
    assert rrows == [1] and rest.prompt == (True,) and rest.prompt_mask() is True
    assert batch.prompt_mask().tolist() == [False, True]
    with pytest.raises(ValueError, match="prompt has 1 flags for 2 sequences"):
        dataclasses.replace(batch, prompt=(True,))


class _NoLora:
    lora = None
