"""Prompt CUDA graphs of the hybrid families (granitehybrid, lfm2, lfm2moe, qwen3next) against
their eager prompts, on the converted tiny fixtures (tests/data/families); `prefill_graphs.STATEFUL`
on.

A prompt graph's padded rows reach the recurrent layers as two sequences, the chunk's rows on
its state slot and the padding on the scratch slot (`engine.layers.recurrent.prompt_graph_plans`),
all from device tensors; Qwen3-Next's DeltaNet layers run all the rows as the chunk's, the
padding's decay and write strength zeroed, and gather the conv state at the chunk's end.
Chunks: a fresh 32-token prompt (an exact bucket), a 40-token chunk after it (padded to 48, its
state read from the slot), a 37-token prompt on another slot and 33 tokens after it, every slot
starting as NaN (what a previous owner may leave).
CPU under TRITON_INTERPRET=1: `PrefillGraphs.forward` (the captured function, run eagerly) with
the recurrent layers on their triton kernels equals the torch reference's eager chunks (hidden
states, KV rows, the chunks' states), token-by-token scan and the chunked scan (chunks of 16,
so a chunk's rows cross chunk borders; for qwen3next the delta rule's two-phase GPU form,
`delta_rule_blocks`, against the CPU's per-block one), and a slot nobody owns stays untouched.
GPU (marked `gpu`): the same through real replays; the engine's greedy tokens with hybrid prompt
graphs on and off (a prompt cut into chunks by the step budget, a batch of four, each alone,
n = 2 forks) agree up to a near-tie of the precise reference, and the prompts really replayed.
The GPU tests run on tiny synthetic lfm2, lfm2moe, granitehybrid and qwen3next files
(`tiny_hybrids`): the fixtures' head dim of 8 has no device-context attention kernel and their
F16 experts are not packed on a GPU, so `prefill_graphs.declined` keeps their prompts eager.
"""

import gc

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.layers import recurrent
from localllm.engine.loader import build_model
from localllm.engine.runtime import prefill_graphs
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.prefill_graphs import PrefillGraphs, bucket_of
from localllm.engine.runtime.recurrent_state import attach_states
from tests.engine.family_goldens import path
from tests.engine.near_ties import assert_same_or_near_tie
from tests.engine.tiny_hybrids import KINDS, write_tiny_hybrid
from tests.triton_env import INTERPRET

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NAMES = ["granitehybrid", "lfm2", "lfm2moe", "qwen3next"]
BS = 16
NB = 12  # blocks in the test caches; the last one is the spare
SPARE = (NB - 1) * BS
TABLES = ([7, 2, 9, 0, 4, 8], [3, 10, 1, 5, 6])
SLOTS = 4  # state slots: the sequences take 2 and 0, slot 1 is nobody's
SEQ_SLOT = (2, 0)
IDLE = 1
SENTINEL = 7.0
# (sequence, first position, tokens)
CHUNKS = [(0, 0, 32), (0, 32, 40), (1, 0, 37), (1, 37, 33)]


def _slots(table, n):
    return [table[p // BS] * BS + p % BS for p in range(n)]


def _cache(model, device):
    layers, kvh, hd = model.kv_shape()
    dtype = "f16" if device != "cpu" else "f32"
    kv = PagedKVCache(layers, NB, BS, kvh, hd, dtype, device, model.kv_value_dim())
    for t in kv.k + kv.v:
        t.zero_()
    states = attach_states(kv, model, SLOTS)
    for i, layer in states.shapes.items():
        for name in layer:
            states.tensor(i, name).fill_(float("nan"))
            states.tensor(i, name)[IDLE] = SENTINEL
    return kv


def _eager(model, kv, chunk, start, table, slot, device):
    n, end = len(chunk), start + len(chunk)
    slots = torch.tensor(_slots(table, end)[start:], device=device)
    meta = BatchMeta((0, n), (end,), (tuple(table[: -(-end // BS)]),), slots, BS,
                     state_slots=(slot,))  # fmt: skip
    ids, pos = torch.tensor(chunk, device=device), torch.arange(start, end, device=device)
    return model(ids, pos, meta, kv)


def _states(kv, slot):
    st = kv.states
    return [st.tensor(i, s)[slot].float().cpu() for i, layer in st.shapes.items() for s in layer]


@torch.inference_mode()
def _compare(name, device, replay, on_triton=lambda: None, off_triton=lambda: None, file=None):
    """CHUNKS eagerly and through prompt graphs: per chunk (eager hidden, graph hidden, eager KV
    rows, graph KV rows, eager states, graph states); the idle slot checked untouched. `file`:
    the GGUF (default: the fixture `name`)."""
    with open_gguf(str(file or path(name))) as gg:
        model = build_model(gg, precise=device == "cpu", device=device)
        kv_e, kv_g = _cache(model, device), _cache(model, device)
        prompts = PrefillGraphs(model, kv_g, SPARE, max_blocks=8)
        assert prompts.usable == (device == "cuda"), prompts.declined
        vocab = model.args.vocab_size
        g = torch.Generator().manual_seed(3)
        out = []
        for seq, start, n in CHUNKS:
            table, slot = TABLES[seq], SEQ_SLOT[seq]
            chunk = torch.randint(0, vocab, (n,), generator=g).tolist()
            ref = _eager(model, kv_e, chunk, start, table, slot, device)
            ids = torch.tensor(chunk, device=device)
            s = _slots(table, start + n)[start:]
            slots = torch.tensor(s, device=device)
            if replay:
                got = prompts.run(ids, slots, start, table, slot)
                assert got is not None, prompts.failed
            else:  # the captured function, on the triton kernels, over the padded input
                inputs = torch.zeros(3, bucket_of(n), dtype=torch.long, device=device)
                prompts.fill(inputs, ids, slots, start, table, slot)
                on_triton()
                try:
                    got = prompts.forward(inputs)[:n]
                finally:
                    off_triton()
            kv_rows = [[t.flatten(0, 1)[s].float().cpu() for t in kv.k + kv.v]
                       for kv in (kv_e, kv_g)]  # fmt: skip
            out.append((ref.float().cpu(), got.float().cpu(), *kv_rows,
                        _states(kv_e, slot), _states(kv_g, slot)))  # fmt: skip
        if replay:
            assert sorted(prompts.graphs) == [32, 48], list(prompts.graphs)
        for t in _states(kv_g, IDLE):
            assert (t == SENTINEL).all(), name  # nobody's slot: untouched
        return out


def _assert_same(out, tol):
    for chunk in out:
        ref, got, kv_ref, kv_got, st_ref, st_got = chunk
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        for a, b in zip(kv_got + st_got, kv_ref + st_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hybrids")
    return {name: write_tiny_hybrid(root, name) for name in KINDS}


@pytest.fixture
def stateful(monkeypatch):
    monkeypatch.setattr(prefill_graphs, "STATEFUL", True)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 with triton")
@pytest.mark.parametrize("scan", ["token", "chunked"])
@pytest.mark.parametrize("name", NAMES)
def test_padded_prompt_forward_equals_eager_on_cpu(name, scan, monkeypatch):
    from localllm.kernels.recurrent import delta_rule

    blocks = scan == "chunked" and name == "qwen3next"  # the GPU's two-phase delta rule
    if scan == "chunked" and not blocks:
        if not name.startswith("granite"):
            pytest.skip("no Mamba-2 scan")
        from localllm.kernels.recurrent import triton_ssd_chunked

        monkeypatch.setattr(recurrent, "CHUNKED_MIN_ROWS", 32)
        monkeypatch.setattr(triton_ssd_chunked, "CHUNK", 16)
    plain, cuda32 = recurrent.use_triton, delta_rule._cuda32
    # eager: the torch reference (CPU tensors); the graph's function: the triton kernels

    def on():
        monkeypatch.setattr(recurrent, "use_triton", lambda x: True)
        if blocks:
            monkeypatch.setattr(delta_rule, "_cuda32", lambda t: t.dtype == torch.float32)

    def off():
        monkeypatch.setattr(recurrent, "use_triton", plain)
        monkeypatch.setattr(delta_rule, "_cuda32", cuda32)

    _assert_same(_compare(name, "cpu", False, on, off), 1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scan", ["token", "chunked"])
@pytest.mark.parametrize("name", sorted(KINDS))
def test_prompt_graph_replay_equals_eager(tiny, name, scan, stateful, monkeypatch):
    if scan == "chunked":
        if "granite" not in name:
            pytest.skip("no Mamba-2 scan")
        from localllm.kernels.recurrent import triton_ssd_chunked

        monkeypatch.setattr(recurrent, "CHUNKED_MIN_ROWS", 32)
        monkeypatch.setattr(triton_ssd_chunked, "CHUNK", 16)
    # f16 KV and GEMMs whose row count differs with the padding: the hybrids' decode-graph
    # tolerance (test_hybrid_graphs)
    _assert_same(_compare(name, "cuda", True, file=tiny[name]), 5e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", sorted(KINDS))
def test_engine_tokens_same_with_and_without_prompt_graphs(tiny, name, stateful):
    from localllm.engine import LLM, SamplingParams

    base = [(37 * i + 11) % 500 for i in range(40)]
    long = (base * 4)[:100]  # 100 tokens in steps of at most 48: 48 + 48 (graphs) + 4 (eager)
    prompts = [long, base[::-1], base[:32], (base * 2)[:41]]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    forks = SamplingParams(temperature=0, max_tokens=16, n=2, ignore_eos=True)
    out = {}
    for flag in (False, True):
        llm = LLM(str(tiny[name]), device="cuda", max_model_len=256, block_size=BS,
                  max_num_batched_tokens=48)  # fmt: skip
        graphs = llm.engine.runner.prompts
        assert graphs is not None and graphs.usable
        replays = []
        if not flag:
            llm.engine.runner.prompts = None  # the eager path
        else:  # count the chunks that replayed (run returns None where it stays eager)
            graphs.run = _counting(graphs.run, replays)
        together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        alone = [list(llm.generate([p], greedy)[0].outputs[0].token_ids) for p in prompts]
        fork = [list(c.token_ids) for c in llm.generate([long], forks)[0].outputs]
        out[flag] = (together, alone, fork)
        if flag:  # the prompts alone really replayed: 48 (the long one's steps, the 41) and 32
            assert graphs.failed is None, graphs.failed
            assert {32, 48} <= set(graphs.graphs), list(graphs.graphs)
            assert sum(replays) >= 5, replays  # alone at least: 2 + 1 + 1 + 1
        llm.close()
        del llm, graphs
        gc.collect()
        torch.cuda.empty_cache()
    p = tiny[name]
    for got, want, ps in zip(out[True], out[False], (prompts, prompts, [long] * 2), strict=True):
        assert_same_or_near_tie(p, ps, got, want)


def _counting(run, replays: list):
    def counted(*args):
        out = run(*args)
        replays.append(out is not None)
        return out

    return counted


def test_chunk_table_on_the_device_matches_the_host_one():
    """`_device_chunks` for n real rows of p: the host `chunk_table` of (0, n, p), plus an empty
    chunk at the end where the two sequences need one chunk fewer."""
    pytest.importorskip("triton")
    from localllm.kernels.recurrent.triton_ssd_chunked import CHUNK, chunk_table

    for p in (32, 64, 96, 512):
        for n in sorted({1, 31, 32, 33, CHUNK - 1, CHUNK, CHUNK + 1, p - 1, p} - {0}):
            if n > p:
                continue
            chunks, seq = recurrent._device_chunks(torch.tensor(n), p)
            rows, first = chunk_table([0, n, p])
            want = [tuple(rows[i : i + 2]) for i in range(0, len(rows), 2)]
            got = [tuple(r) for r in chunks.tolist()]
            assert got[: len(want)] == want, (p, n)
            assert all(r == (p, p) for r in got[len(want) :]), (p, n)
            assert seq.tolist() == [first[0], first[1], len(got)], (p, n)
