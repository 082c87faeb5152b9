"""Decode CUDA graphs of the hybrid families (lfm2, lfm2moe, granitehybrid, qwen3next) against
their eager decode, on the converted tiny fixtures (tests/data/families).

A graph's rows carry each sequence's recurrent-state slot; the captured forward reads the slots
and their freshness (seq_len 1) from those device rows; padding rows use the scratch state slot
and a spare KV slot (their state is not row 0's, so neither are the K/V they would write).
CPU (always run): `DecodeGraphs.forward` (the function a graph captures, run eagerly) over rows
filled as a replay fills them, each step after a capture's warm-up, equals eager batched decode
token by token, logits and states, for 1, 3 (padded to 4) and 4 sequences in shuffled slots, one
of them starting at position 0; a slot nobody owns is left untouched; under TRITON_INTERPRET=1,
qwen3next's so through its triton decode steps. The engine's runner through that emulated graph
path (each request's state slot in its row) gives its eager path's greedy tokens, batched,
alone and forked. GPU (marked `gpu`): the same with real replays,
then the engine's greedy tokens with graphs on and off (a batch of four, each alone, n = 2 forks)
agree up to a near-tie of the precise reference, and decode really went through the graphs.
"""

import dataclasses
import gc

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.cuda_graphs import COLS, DecodeGraphs, fill_rows, pack_decode
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states
from tests.engine.family_goldens import golden, path
from tests.engine.near_ties import assert_same_or_near_tie
from tests.triton_env import INTERPRET

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NAMES = ["lfm2", "lfm2moe", "granitehybrid", "granitehybrid_dense", "qwen3next"]
BS = 16
STEPS = 20  # prompts of up to 11 tokens: every sequence crosses a block boundary
SLOTS = 5  # state slots; rows take 3, 0, 4, 1 (slot 2 is nobody's)
ROW_SLOTS = [3, 0, 4, 1]
TABLES = [[7, 2], [0, 9], [5, 3], [8, 1]]
IDLE = 2
SENTINEL = 7.0
PAD_SLOT = 10 * BS  # the spare block's first KV slot: the padding rows' writes


def _prompts(name: str) -> list[list[int]]:
    p = golden(name)["prompt"]["ids"]
    return [p[:11], p[3:9], [], p[5:15]]  # the third starts its state at its first decode step


def _meta(n_new, seq_lens, tables, states, device) -> BatchMeta:
    meta = BatchMeta.from_tables(n_new, seq_lens, tables, BS)
    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device),
                               state_slots=tuple(states))  # fmt: skip


def _cache(model, device: str) -> PagedKVCache:
    layers, kvh, hd = model.kv_shape()
    dtype = "f16" if device != "cpu" else "f32"
    kv = PagedKVCache(layers, 11, BS, kvh, hd, dtype, device, model.kv_value_dim())
    states = attach_states(kv, model, SLOTS)
    for i, layer in states.shapes.items():  # what stale slots may hold; nobody's slot marked
        for name in layer:
            states.tensor(i, name).fill_(float("nan"))
            states.tensor(i, name)[IDLE] = SENTINEL
    return kv


@torch.inference_mode()
def _compare(name: str, n: int, device: str, replay: bool):
    """Teacher-forced decode of n sequences, eager and through the graph path: both logit
    sequences [STEPS, n, vocab] and both caches."""
    with open_gguf(path(name)) as g:
        model = build_model(g, precise=device == "cpu", device=device)  # CPU: fp32 matmuls
        kv_e, kv_g = _cache(model, device), _cache(model, device)
        prompts, states, tables = _prompts(name)[:n], ROW_SLOTS[:n], TABLES[:n]
        toks = []
        for p, s, t in zip(prompts, states, tables, strict=True):
            tok = 1
            for kv in (kv_e, kv_g):
                if p:
                    meta = _meta([len(p)], [len(p)], [t], [s], device)
                    ids = torch.tensor(p, device=device)
                    hidden = model(ids, torch.arange(len(p), device=device), meta, kv)
                    tok = int(model.logits(hidden[-1:]).argmax())
            toks.append(tok)
        graphs = DecodeGraphs(model, kv_g, pad_slot=PAD_SLOT)
        pos = [len(p) for p in prompts]
        eager, got = [], []
        for _ in range(STEPS):
            kv_slots = [t[q // BS] * BS + q % BS for t, q in zip(tables, pos, strict=True)]
            meta = _meta([1] * n, [q + 1 for q in pos], tables, states, device)
            ids, where = torch.tensor(toks, device=device), torch.tensor(pos, device=device)
            le = model.logits(model(ids, where, meta, kv_e)).float()
            used = [t[: q // BS + 1] for t, q in zip(tables, pos, strict=True)]
            rows = pack_decode(toks, pos, kv_slots, used, states=states).to(device)
            if replay:
                lg = graphs.run(rows)
                assert lg is not None, graphs.failed
            else:  # the captured function over the rows a replay would hold, each step after
                # a capture's warm-up (which must leave no trace in the states or the KV read)
                b, width = graphs.key(n, rows.shape[1] - COLS)[:2]
                static = torch.zeros(b, COLS + width, dtype=torch.long, device=device)
                fill_rows(static, rows, None, graphs.pad)
                graphs.forward(graphs.warm_inputs(static))
                lg = graphs.forward(static)[:n]
            eager.append(le.cpu())
            got.append(lg.clone().cpu())
            toks = le.argmax(-1).tolist()
            pos = [q + 1 for q in pos]
        if replay:
            assert graphs.failed is None and len(graphs.graphs) == 1, graphs.failed
        return torch.stack(eager), torch.stack(got), kv_e, kv_g


def _assert_same(name, eager, got, kv_e, kv_g, n, tol):
    torch.testing.assert_close(got, eager, rtol=tol, atol=tol)
    top2 = eager.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 4 * tol
    assert clear.sum() >= clear.numel() // 2, name
    assert torch.equal(got.argmax(-1)[clear], eager.argmax(-1)[clear]), name
    used = torch.tensor(ROW_SLOTS[:n])
    st_e, st_g = kv_e.states, kv_g.states
    for i, layer in st_g.shapes.items():
        for s in layer:
            a, b = st_g.tensor(i, s).cpu(), st_e.tensor(i, s).cpu()
            torch.testing.assert_close(a[used], b[used], rtol=tol, atol=tol)
            assert (a[IDLE] == SENTINEL).all(), (name, i, s)  # nobody's slot: untouched


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("name", NAMES)
def test_graph_forward_equals_eager_decode_on_cpu(name, n):
    eager, got, kv_e, kv_g = _compare(name, n, "cpu", replay=False)
    _assert_same(name, eager, got, kv_e, kv_g, n, 1e-4)


class _Emulated:
    """`DecodeGraphs.run` on a CPU: the rows filled as a replay fills them, a capture's warm-up
    on a shape's first use, then the captured function run eagerly."""

    def __init__(self, graphs: DecodeGraphs):
        self.graphs, self.batch_sizes = graphs, graphs.batch_sizes
        self.keys: list[tuple] = []

    def run(self, inputs, ids=None, then=None):
        n, w = inputs.shape[0], inputs.shape[1] - COLS
        key = self.graphs.key(n, w)
        if key is None:
            return None
        static = torch.zeros(key[0], COLS + key[1], dtype=torch.long)
        fill_rows(static, inputs, ids, self.graphs.pad)
        if key not in self.keys:
            self.graphs.forward(self.graphs.warm_inputs(static))
        self.keys.append(key)
        logits = self.graphs.forward(static)[:n]
        return logits if then is None else then(logits)


@pytest.mark.parametrize("name", NAMES)
def test_engine_through_emulated_graphs_equals_eager_on_cpu(name):
    """The runner's graph path (rows with each request's state slot, padding on the scratch slot
    and a KV slot nobody owns, forks' copied states) against its eager path, on a CPU."""
    from localllm.engine import LLM, SamplingParams

    prompt = golden(name)["prompt"]["ids"]
    prompts = [prompt, prompt[::-1], prompt[3:25]]  # three rows: padded to four
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    forks = SamplingParams(temperature=0, max_tokens=16, n=2, ignore_eos=True)
    out = {}
    for emulate in (False, True):
        with LLM(str(path(name)), max_model_len=128, block_size=BS, precise=True) as llm:
            runner = llm.engine.runner
            assert runner.graphs is None  # (a CPU engine)
            if emulate:
                spare = llm.engine.kv_manager.pool.get_new_blocks(1)[0].block_id  # nobody's
                runner.graphs = _Emulated(
                    DecodeGraphs(runner.model, runner.kv, pad_slot=spare * BS)
                )
            together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
            alone = [list(llm.generate([p], greedy)[0].outputs[0].token_ids) for p in prompts]
            fork = [list(c.token_ids) for c in llm.generate([prompt], forks)[0].outputs]
            out[emulate] = (together, alone, fork)
            if emulate:  # decode went through the graph path: padded, alone and forked
                assert {k[0] for k in runner.graphs.keys} >= {1, 2, 4}, runner.graphs.keys
    p = path(name)
    for got, want, ps in zip(out[True], out[False], (prompts, prompts, [prompt] * 2), strict=True):
        assert_same_or_near_tie(p, ps, got, want)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 with triton")
def test_qwen3next_graph_forward_on_the_triton_steps(monkeypatch):
    """qwen3next's decode steps through its triton kernels, on CPU tensors under the interpreter
    (on CUDA the replays below run them): the graph rows hand those kernels the state slots as
    the plain array they index, padding rows included."""
    from localllm.kernels.recurrent import decode

    monkeypatch.setattr(decode, "_cuda32", lambda *xs: True)
    eager, got, kv_e, kv_g = _compare("qwen3next", 3, "cpu", replay=False)
    _assert_same("qwen3next", eager, got, kv_e, kv_g, 3, 1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("name", NAMES)
def test_graph_replay_equals_eager_decode(name, n):
    eager, got, kv_e, kv_g = _compare(name, n, "cuda", replay=True)
    # f16 KV and GEMMs whose row count differs with the padding: the dense families' tolerance
    # (test_gpu_graphs), widened as for the hybrids' goldens (Granite's scales, the SSM's exp)
    _assert_same(name, eager, got, kv_e, kv_g, n, 5e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", NAMES)
def test_engine_tokens_same_with_and_without_graphs(name):
    from localllm.engine import LLM, SamplingParams

    prompt = golden(name)["prompt"]["ids"]
    prompts = [prompt, prompt[::-1], prompt[3:25], prompt[10:]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    forks = SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
    out = {}
    for flag in (False, True):
        llm = LLM(str(path(name)), device="cuda", max_model_len=256, block_size=BS)
        graphs = llm.engine.runner.graphs
        assert graphs is not None  # on by default on CUDA, hybrids included
        if not flag:
            llm.engine.runner.graphs = None  # the eager path
        together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        alone = [list(llm.generate([p], greedy)[0].outputs[0].token_ids) for p in prompts]
        fork = [list(c.token_ids) for c in llm.generate([prompt], forks)[0].outputs]
        out[flag] = (together, alone, fork)
        if flag:  # decode really went through graphs: alone, forks, and the batch of four
            assert graphs.failed is None, graphs.failed
            assert {k[0] for k in graphs.graphs} >= {1, 2, 4}, list(graphs.graphs)
        llm.close()
        del llm, graphs  # the next engine sizes its KV cache from the free memory
        gc.collect()
        torch.cuda.empty_cache()
    (e_together, e_alone, e_fork), (g_together, g_alone, g_fork) = out[False], out[True]
    p = path(name)
    assert_same_or_near_tie(p, prompts, g_together, e_together)
    assert_same_or_near_tie(p, prompts, g_alone, e_alone)
    assert_same_or_near_tie(p, [prompt] * 2, g_fork, e_fork)
    # with graphs, the forks and the batch equal each prompt alone (up to a near-tie)
    assert_same_or_near_tie(p, [prompt] * 2, g_fork, [g_alone[0]] * 2)
    assert_same_or_near_tie(p, prompts, g_together, g_alone)
