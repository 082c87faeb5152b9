"""Experts prepared once for CPU compute: the prepared FFN vs the dense raw-block oracle within
each strategy's error, exact byte counts, resident and streamed prepared experts giving the same
bits, no re-preparation on slot hits, and a tiny qwen3moe model's greedy tokens identical
resident vs streamed with preparation on.

The engine does not pass `prepared=` / `prepare=` yet (engine/moe/block.py is wired separately), so
the model tests build the sources here and attach them to the MoE blocks; `MoEFeedForward.fetch`
is patched to hand a PreparedExpert through untouched (its device check reads raw blocks).
"""

import itertools
import threading
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import MoEFeedForward, moe_blocks
from localllm.engine.sampling.params import SamplingParams
from localllm.kernels.moe import (
    ExpertBiases,
    ExpertBlocks,
    ExpertFormat,
    expert_ffn_grouped,
    expert_ffn_reference,
)
from localllm.kernels.moe.prepared import (
    PreparedExpert,
    prepare_expert,
    prepared_expert_nbytes,
    prepared_format_nbytes,
)
from localllm.kernels.quant import QuantType
from localllm.offload import expert_cache
from localllm.offload.expert_cache import StreamedExperts
from localllm.offload.expert_source import ExpertLayout, ResidentExperts
from localllm.offload.ranges import ByteRange
from tests.offload.tiny_moe import MoESpec, write_moe_gguf

E, D, H = 6, 256, 512  # K = 256 or 512: whole K-quant super-blocks
# ||y - ref|| / ||ref|| bounds per strategy (kernels/quant/linear.py): int4pack's bf16 GEMV
# rounds x and the per-32 scales to bf16 (~3e-3 per matmul, three chained); the fp16 copy
# rounds W (and x below 8 rows) to fp16 (~3e-4); int4pack from 64 rows is exact (~1e-7).
REL_TOL = {"int4pack1": 1e-2, "dense_f16": 2e-3}  # measured up to 5e-3 and 7e-4
EXACT_TOL = 1e-5
# fp16 scale fields (byte offset, magnitude) that give weights of ~0.02 from random codes
K_SCALES = {QT.Q4_K: ((0, 2e-4), (2, 2e-4)), QT.Q6_K: ((208, 1e-5),)}


def expert_blocks(qtype: QT, n_expert: int, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [n_expert, rows, row_bytes]: gguf's quantizer on gaussian weights where it has one;
    Q4_K/Q6_K (gguf-py cannot quantize them) get random codes and realistic fp16 scales."""
    if qtype in K_SCALES:
        block, nb = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n_expert * rows * cols // block, nb), dtype=np.uint8)
        for off, mag in K_SCALES[qtype]:
            d = (rng.uniform(0.5, 1.5, raw.shape[0]) * mag).astype(np.float16)
            raw[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
        return raw.reshape(n_expert, rows, -1)
    w = (rng.standard_normal((n_expert, rows, cols)) / np.sqrt(cols)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)


def _layer(fmt: ExpertFormat, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    shapes = ((fmt.gate, H, D), (fmt.up, H, D), (fmt.down, D, H))
    return tuple(
        torch.from_numpy(expert_blocks(QT(int(q)), E, r, c, rng).copy()) for q, r, c in shapes
    )


def _fmt(gate_up: QT, down: QT, act: str = "silu") -> ExpertFormat:
    g, d = QuantType(int(gate_up)), QuantType(int(down))
    return ExpertFormat(g, g, d, D, H, act)


def _routing(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    return torch.rand(tokens, k, generator=gen), ids


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


CASES = [  # (gate/up type, down type, the strategy each gets)
    (QT.Q4_K, QT.Q4_K, "int4pack1", "int4pack1"),
    (QT.Q6_K, QT.Q6_K, "dense_f16", "dense_f16"),
    (QT.Q8_0, QT.Q8_0, "dense_f16", "dense_f16"),
    (QT.Q4_0, QT.Q4_0, "int4pack1", "int4pack1"),
    (QT.Q4_K, QT.Q6_K, "int4pack1", "dense_f16"),  # Qwen3-30B-A3B Q4_K_M's mix
]


@pytest.mark.parametrize(("gu", "dn", "kind_gu", "kind_dn"), CASES)
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_prepared_ffn_matches_reference(gu, dn, kind_gu, kind_dn, tokens):
    fmt = _fmt(gu, dn)
    g, u, d = _layer(fmt, seed=tokens)
    prepared = [prepare_expert(ExpertBlocks(g[e], u[e], d[e]), fmt) for e in range(E)]
    assert (prepared[0].gate.kind, prepared[0].down.kind) == (kind_gu, kind_dn)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(7))
    # 70 tokens on every expert: each gets >= 64 rows, the exact paths (int4pack unpacks to
    # fp32 tiles, fp16 is widened to fp32 tiles); fewer rows take the rounding GEMVs
    w, ids = _routing(tokens, E if tokens >= 64 else 2, seed=tokens)
    fetched = []
    y = expert_ffn_grouped(x, w, ids, lambda e: fetched.append(e) or prepared[e], fmt)
    ref = expert_ffn_reference(x, w, ids, g, u, d, fmt)
    assert fetched == sorted(set(ids.reshape(-1).tolist()))
    assert ref.abs().max() > 1e-3  # a real signal, not zeros
    tol = {**REL_TOL, "int4pack1": EXACT_TOL} if tokens >= 64 else REL_TOL
    assert _rel(y, ref) < max(tol[kind_gu], tol[kind_dn])
    raw = expert_ffn_grouped(x, w, ids, lambda e: ExpertBlocks(g[e], u[e], d[e]), fmt)
    assert _rel(raw, ref) < EXACT_TOL  # the raw path (dequantize + fp32) is untouched
    if tokens < 8:
        assert not torch.equal(y, ref)  # the prepared (rounding) kernels really ran


@pytest.mark.parametrize("act", ["silu", "gelu", "swiglu_oai"])
def test_prepared_with_biases_and_activations(act):
    """gpt-oss's biased experts and the other activations take the prepared path too."""
    fmt = _fmt(QT.Q8_0, QT.Q8_0, act)
    g, u, d = _layer(fmt, seed=11)
    gen = torch.Generator().manual_seed(3)
    biases = ExpertBiases(*(0.1 * torch.randn(E, n, generator=gen) for n in (H, H, D)))
    prepared = [prepare_expert(ExpertBlocks(g[e], u[e], d[e]), fmt) for e in range(E)]
    x = torch.randn(4, D, generator=gen)
    w, ids = _routing(4, 3, seed=2)
    y = expert_ffn_grouped(x, w, ids, prepared.__getitem__, fmt, biases)
    ref = expert_ffn_reference(x, w, ids, g, u, d, fmt, biases)
    no_bias = expert_ffn_reference(x, w, ids, g, u, d, fmt)
    assert _rel(y, ref) < REL_TOL["dense_f16"] < _rel(no_bias, ref)


@pytest.mark.parametrize(
    ("qtype", "rows", "cols", "want"),
    [
        (QT.Q4_K, 768, 2048, 768 * 2048 * 7 // 8),  # int4pack: 0.875 B/weight
        (QT.Q4_0, 64, 256, 64 * 256 * 7 // 8),
        (QT.Q6_K, 2048, 768, 2048 * 768 * 2),  # fp16 copy
        (QT.Q8_0, 64, 256, 64 * 256 * 2),
        (QT.Q5_0, 64, 256, 64 * 256 * 2),  # POLICY: fp16 (int4pack would need two planes)
        (QT.F16, 64, 256, 0),  # used in place
        (QT.MXFP4, 64, 256, 0),  # no fast CPU form: dequant tiles over the raw blocks
        (QT.Q4_0, 40, 256, 40 * 256 * 2),  # rows % 16 != 0: int4pack falls back to fp16
    ],
)
def test_prepared_nbytes_exact(qtype, rows, cols, want):
    """The planner's figure equals what a prepared expert really holds (gate = up = `qtype`
    [rows, cols]; down F32 [cols, rows], used in place: 0 bytes)."""
    q = QuantType(int(qtype))
    assert prepared_expert_nbytes(q, rows, cols) == want
    rng = np.random.default_rng(0)
    if qtype == QT.F16:
        raw = rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    elif qtype == QT.MXFP4:
        raw = rng.integers(0, 120, (rows, cols // 32 * 17), dtype=np.uint8)
    else:
        raw = expert_blocks(qtype, 1, rows, cols, rng)
    gu = torch.from_numpy(np.ascontiguousarray(raw)).reshape(rows, -1)
    down = torch.randn(cols, rows).view(torch.uint8)
    fmt = ExpertFormat(q, q, QuantType.F32, cols, rows)
    p = prepare_expert(ExpertBlocks(gu, gu.clone(), down), fmt)
    assert p.nbytes == 2 * want == prepared_format_nbytes(fmt)


def _on_disk(tmp_path, layers: dict[int, tuple], fmts: dict[int, ExpertFormat]):
    """Write each layer's three expert tensors to one file; their ExpertLayouts (with fmt)."""
    path, pos, layouts = tmp_path / "experts.bin", 64, {}  # a header's worth of other bytes
    with path.open("wb") as f:
        f.write(bytes(pos))
        for layer, tensors in layers.items():
            ranges = []
            for t in tensors:
                f.write(t.numpy().tobytes())
                ranges.append(ByteRange(str(path), pos, t.numel()))
                pos += t.numel()
            shapes = tuple(tuple(t.shape[1:]) for t in tensors)
            layouts[layer] = ExpertLayout(E, tuple(ranges), shapes, fmts[layer])
    return layouts


STREAM_MODES = [  # (slots, prefetch, evict)
    (1, False, "lru"),
    (2, False, "lfu"),
    (3, True, "lru"),
    (2, True, "lfu"),
]


@pytest.mark.parametrize(("slots", "prefetch", "evict"), STREAM_MODES)
def test_resident_and_streamed_prepared_give_the_same_bits(tmp_path, slots, prefetch, evict):
    fmts = {0: _fmt(QT.Q4_K, QT.Q6_K), 1: _fmt(QT.Q4_0, QT.Q8_0)}
    layers = {i: _layer(f, seed=20 + i) for i, f in fmts.items()}
    resident = ResidentExperts(layers, prepared=fmts)
    raw = ResidentExperts(layers)  # no preparation: raw blocks
    streamed = StreamedExperts(_on_disk(tmp_path, layers, fmts), slots, prefetch, evict, True)
    lazy = ResidentExperts(layers, prepared=fmts, lazy=True)
    assert lazy.nbytes == 0 and resident.nbytes == E * sum(
        map(prepared_format_nbytes, fmts.values())
    )
    gen, fetched = torch.Generator().manual_seed(5), set()
    for step in range(6):
        tokens = 1 if step else 9  # a prefill, then decode steps
        x = torch.randn(tokens, D, generator=gen)
        for layer, fmt in fmts.items():
            w, ids = _routing(tokens, 2, seed=100 * step + layer)
            outs = []
            for src in (resident, streamed, raw, lazy):
                src.routed(layer, ids)
                if layer == 0:  # the next layer's read-ahead, as the engine hints it
                    src.guess(1, _routing(1, 2, seed=step)[1][0].tolist())
                outs.append(
                    expert_ffn_grouped(x, w, ids, lambda e, s=src, i=layer: s.fetch(i, e), fmt)
                )
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[3]), (step, layer)
            fetched |= {(layer, e) for e in ids.unique().tolist()}
            made = {(i, e) for i, ps in lazy.prepared.items() for e, p in enumerate(ps) if p}
            assert made == fetched  # lazy: exactly the experts fetched so far were prepared
            assert not torch.equal(outs[0], outs[2])  # prepared is not the raw path
            assert _rel(outs[0], outs[2]) < REL_TOL["int4pack1"]
    streamed.close()
    s = streamed.stats
    assert s.misses > 0 and s.hits + s.misses == s.lookups == resident.stats.lookups
    # every read was prepared once, hits reused it
    assert s.prepared == s.misses + s.prefetched
    assert (s.prefetched > 0) == prefetch


def test_streamed_hits_do_not_reprepare_and_memory_is_bounded(tmp_path, monkeypatch):
    fmts = {0: _fmt(QT.Q4_K, QT.Q6_K)}
    layers = {0: _layer(fmts[0], seed=3)}
    threads: list[str] = []
    real = expert_cache.prepare_expert

    def counting(blocks, fmt, native=None):
        threads.append(threading.current_thread().name)
        return real(blocks, fmt, native=native)

    monkeypatch.setattr(expert_cache, "prepare_expert", counting)
    cache = StreamedExperts(_on_disk(tmp_path, layers, fmts), slots=2, prepare=True)
    seq = [0, 1, 0, 0, 2, 1, 1, 3, 3, 0]
    got = [cache.fetch(0, e) for e in seq]
    # 0 1 miss; 0 0 hit; 2 evicts 1; 1 evicts 0; 1 hit; 3 evicts 2; 3 hit; 0 evicts 1
    assert [cache.stats.misses, cache.stats.hits, len(threads)] == [6, 4, 6]
    assert cache.stats.prepared == 6 and cache.stats.prepare_seconds > 0
    assert got[2] is got[0] and got[3] is got[0] and got[6] is got[5] and got[8] is got[7]
    assert all(isinstance(p, PreparedExpert) for p in got)
    per_expert = prepared_format_nbytes(fmts[0])
    assert got[0].nbytes == per_expert == 2 * (H * D * 7 // 8) + D * H * 2
    raw = sum(t[0].numel() for t in layers[0])
    assert cache.nbytes == 2 * (raw + per_expert)
    live = {id(p) for p in cache._prepared if p is not None}
    assert len(live) == 2  # one prepared expert per slot, the evicted ones dropped
    # read-ahead prepares on the reading thread
    pre = StreamedExperts(_on_disk(tmp_path, layers, fmts), 2, prefetch=True, prepare=True)
    threads.clear()
    pre.guess(0, [4, 5])
    pre.close()
    assert threads == ["expert-prefetch_0"] * 2 and pre.stats.prepared == 2


def test_prepare_needs_formats(tmp_path):
    fmts = {0: _fmt(QT.Q8_0, QT.Q8_0)}
    layouts = _on_disk(tmp_path, {0: _layer(fmts[0], seed=1)}, fmts)
    bare = {0: ExpertLayout(E, layouts[0].ranges, layouts[0].shapes)}
    with pytest.raises(ValueError, match="fmt"):
        StreamedExperts(bare, 2, prepare=True)
    with pytest.raises(ValueError, match="do not match"):
        ExpertLayout(E, layouts[0].ranges, layouts[0].shapes, _fmt(QT.Q4_0, QT.Q8_0))


PROMPT = [1, 5, 9, 33, 7, 11, 200, 3]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MODEL_MODES = {  # name -> (slots, prefetch, evict); None: all resident
    "resident": None,
    "2 slots": (2, False, "lru"),
    "2 slots, read-ahead, lfu": (2, True, "lfu"),
    "3 slots, read-ahead": (3, True, "lru"),
}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("prep")
    return {
        qt.name: write_moe_gguf(d / f"{qt.name}.gguf", MoESpec(expert_qtype=qt), seed=3)
        for qt in (QT.Q8_0, QT.Q4_0)
    }


def _generate(path, mode: str, prepare: bool = True):
    """Greedy tokens, teacher-forced logits and the expert source of a tiny model whose experts
    are attached as the engine would with preparation on (resident or streamed)."""
    g = open_gguf(path)
    model = build_model(g)
    blocks = moe_blocks(model)
    fmts = {b.layer: b.format for b in blocks} if prepare else {}
    if MODEL_MODES[mode] is None:
        raw = {b.layer: tuple(w.data for w in b.expert_weights()) for b in blocks}
        source = ResidentExperts(raw, prepared=fmts)
    else:
        slots, prefetch, evict = MODEL_MODES[mode]
        layouts = {}
        for b in blocks:
            layouts[b.layer] = b.stream_layout()
            for t in (b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps):
                t.release()  # the resident blocks cannot be used by mistake
        source = StreamedExperts(layouts, slots, prefetch, evict, prepare=prepare)
        if prefetch:
            for b, nxt in itertools.pairwise(blocks):
                b.guess_next = nxt
    for b in blocks:
        b.attach(source)
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    tokens = list(gen.stream(PROMPT, PARAMS))
    logits = gen.score(PROMPT + tokens)
    if isinstance(source, StreamedExperts):
        source.close()
    return tokens, logits, source


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_tiny_qwen3moe_greedy_identical_resident_vs_streamed(qtype, tiny_moe, monkeypatch):
    # the engine's fetch reads raw blocks' device; until it hands prepared experts through
    monkeypatch.setattr(MoEFeedForward, "fetch", lambda self, e: self.source.fetch(self.layer, e))
    want_tokens, want_logits, resident = _generate(tiny_moe[qtype], "resident")
    assert len(set(want_tokens)) > 3 and resident.nbytes > 0
    assert all(len(p) == 8 for p in resident.prepared.values()) and len(resident.prepared) == 2
    for mode in MODEL_MODES:
        if mode == "resident":
            continue
        tokens, logits, streamed = _generate(tiny_moe[qtype], mode)
        assert tokens == want_tokens, mode
        assert torch.equal(logits, want_logits), mode  # same prepared bits, not just close
        s = streamed.stats
        assert s.misses > 0 and s.prepared == s.misses + s.prefetched, mode
    # the prepared path really ran: the raw-block (exact dequant) run's logits differ a little
    _, raw_logits, _ = _generate(tiny_moe[qtype], "resident", prepare=False)
    assert not torch.equal(raw_logits, want_logits)
    assert _rel(want_logits, raw_logits) < REL_TOL["int4pack1"]


def test_prepared_experts_on_the_block_linears_and_few_prompt_rows():
    """With the native kernels, MXFP4 experts (gpt-oss's) prepare on the block linears: views of
    the raw blocks, nothing owned. An expert's prompt rows below PROMPT_GEMM_MIN_ROWS take the
    int8 rows (the bits the same rows get as decode rows), 16 or more the prompt GEMM; both
    near the dequantized-weights FFN."""
    from localllm.kernels.cpu.native import load as load_native
    from localllm.kernels.moe import experts
    from localllm.kernels.quant.linear_native import NativeLinear, prompt_rows

    native = load_native()
    if native is None or native.blocks is None:
        pytest.skip("no C compiler here")
    fmt = _fmt(QT.MXFP4, QT.MXFP4, "swiglu_oai")
    g, u, d = _layer(fmt, seed=11)
    raw = ExpertBlocks(g[2], u[2], d[2])
    p = prepare_expert(raw, fmt, native=native)
    assert isinstance(p.gate, NativeLinear) and isinstance(p.down, NativeLinear)
    assert p.nbytes == 0
    x = torch.randn(20, D, generator=torch.Generator().manual_seed(3))
    want = experts.expert_ffn_one(x, raw, fmt)  # the float32 values of the blocks
    few = experts.PROMPT_GEMM_MIN_ROWS - 1
    with prompt_rows(False):
        decode = experts.expert_ffn_one(x[:few], p, fmt)
    with prompt_rows(True):
        prompt_few = experts.expert_ffn_one(x[:few], p, fmt)
        prompt_many = experts.expert_ffn_one(x, p, fmt)
    assert torch.equal(prompt_few, decode)
    assert not torch.equal(prompt_many[:few], decode)  # the GEMM's int16 activations
    for got in (decode, prompt_many[:few]):
        rel = ((got - want[:few]).norm() / want[:few].norm()).item()
        assert rel < 3e-2, rel
