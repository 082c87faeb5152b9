"""The native CPU kernels (`kernels/cpu/moe_gemv.c`, built at first use) against dequantized
float math: single matrices per type, a layer's routed experts, thread counts, bad input, and
`load` falling back to None when the compiler or the self-check fails. A tiny MoE on the CPU with
its host experts on the native kernels scores like the torch path (int8 activations: ~1 %)."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import moe_blocks
from localllm.kernels.cpu import native
from localllm.kernels.moe import ExpertFormat, expert_ffn_reference
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.dequant import dequantize
from localllm.offload.expert_source import ResidentExperts
from tests.offload.tiny_moe import QWEN3MOE, write_moe_gguf
from tests.perf.make_synthetic import random_rows

INT8_TOL = 2e-2  # int8 input and SiLU product per 32 values: measured 1.2-1.3 % off exact math


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0])
@pytest.mark.parametrize(("n", "k"), [(37, 256), (300, 768)])
def test_gemv_matches_dequantized_weights(kernels, qtype, n, k):
    rng = np.random.default_rng(n + k)
    w = torch.from_numpy(random_rows(qtype, n, k, rng))
    x = torch.randn(k, generator=torch.Generator().manual_seed(k))
    want = dequantize(w, QuantType(qtype)).reshape(n, k).double() @ x.double()
    got = kernels.gemv(w, QuantType(qtype), n, k, x)
    assert got.shape == (n,) and want.abs().max() > 1e-3
    assert _rel(got, want) < 1.5e-2  # the input rounded to int8 per 256 values
    assert torch.equal(kernels.gemv(w, QuantType(qtype), n, k, x, threads=1), got)


def _fake_int8(v: torch.Tensor, qtype) -> torch.Tensor:
    """v rounded as the kernels quantize it for a weight of `qtype`: int8 codes, one scale per
    256 values for Q4_K (llama.cpp's Q8_K), per 32 for Q6_K and Q8_0."""
    s = v.reshape(-1, 256 if QuantType(qtype) == QuantType.Q4_K else 32)
    scale = s.abs().amax(1, keepdim=True) / 127
    return (torch.round(s / scale.clamp_min(1e-30)) * scale).reshape(v.shape)


def _simulated(x, w, ids, g, u, d, types, act):
    """The kernels' arithmetic in float64: exact weights, activations rounded as for each type."""
    mats = [
        dequantize(t, QuantType(q)).reshape(t.shape[0], t.shape[1], -1).double()
        for t, q in zip((g, u, d), types, strict=True)
    ]
    f = torch.nn.functional
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        xg, xu = (_fake_int8(x[i].double(), types[n]) for n in (0, 1))
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            gate = mats[0][e] @ xg
            gate = f.silu(gate) if act == "silu" else f.gelu(gate, approximate="tanh")
            h = _fake_int8(gate * (mats[1][e] @ xu), types[2])
            out[i] += float(w[i, j]) * (mats[2][e] @ h)
    return out


def _layer(types, n_expert: int, dim: int, hidden: int, seed: int):
    rng = np.random.default_rng(seed)
    g, u, d = (
        torch.from_numpy(np.stack([random_rows(types[i], r, c, rng) for _ in range(n_expert)]))
        for i, (r, c) in enumerate(((hidden, dim), (hidden, dim), (dim, hidden)))
    )
    return g, u, d


@pytest.mark.parametrize(
    ("types", "act"),
    [
        ((QT.Q4_K, QT.Q4_K, QT.Q6_K), "silu"),  # Qwen3-30B-A3B Q4_K_M's mix
        ((QT.Q8_0, QT.Q8_0, QT.Q8_0), "silu"),
        ((QT.Q6_K, QT.Q4_K, QT.Q8_0), "gelu"),
    ],
)
@pytest.mark.parametrize(("tokens", "k_used"), [(1, 8), (3, 2), (40, 4)])  # 40: a prompt's rows
def test_moe_ffn_matches_the_dense_oracle(kernels, types, act, tokens, k_used):
    dim, hidden, n_expert = 256, 512, 10
    g, u, d = _layer(types, n_expert, dim, hidden, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, dim, generator=gen)
    ids = torch.stack([torch.randperm(n_expert, generator=gen)[:k_used] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k_used, generator=gen), -1)
    qt = tuple(QuantType(t) for t in types)
    fmt = ExpertFormat(*qt, dim, hidden, act)
    want = expert_ffn_reference(x, w, ids, g, u, d, fmt)
    got = kernels.moe_ffn(x, w, ids, g, u, d, qt, act)
    assert got.shape == (tokens, dim) and want.abs().max() > 1e-3
    assert _rel(got, want) < INT8_TOL
    # and the arithmetic it claims, the rounding of its activations alone (float32 vs float64
    # products may move a code across a rounding edge: 6e-4 seen; a wrong scale is >= 1e-2)
    assert _rel(got, _simulated(x, w, ids, g, u, d, types, act)) < 2e-3
    # each output is one thread's sum: the thread count cannot change a bit
    assert torch.equal(kernels.moe_ffn(x, w, ids, g, u, d, qt, act, threads=1), got)


@pytest.mark.parametrize(
    "flags", [("-O3", "-march=x86-64-v3", "-fopenmp"), ("-O3", "-fopenmp"), ("-O2",)]
)
def test_every_build_computes_the_same_arithmetic(kernels, tmp_path, flags):
    """The AVX2 (maddubs) path, the plain C path and a build without OpenMP: each within float
    rounding of the simulated arithmetic, like the native build."""
    import ctypes
    import platform

    if "x86-64-v3" in " ".join(flags) and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86-64 build")
    path = native._build(native._compiler(), flags, tmp_path)
    if path is None:
        pytest.skip(f"{flags} does not build here")
    lib = ctypes.CDLL(str(path))
    native._bind(lib)
    other = native.NativeKernels(lib, path, flags)
    assert native.self_check(other)
    types = (QT.Q4_K, QT.Q4_K, QT.Q6_K)
    g, u, d = _layer(types, 6, 256, 512, seed=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen)
    ids = torch.tensor([[0, 5], [2, 0], [3, 1]])
    w = torch.softmax(torch.randn(3, 2, generator=gen), -1)
    qt = tuple(QuantType(t) for t in types)
    got = other.moe_ffn(x, w, ids, g, u, d, qt)
    assert _rel(got, _simulated(x, w, ids, g, u, d, types, "silu")) < 2e-3
    assert _rel(got, kernels.moe_ffn(x, w, ids, g, u, d, qt)) < 1e-3


def test_supports_and_bad_ids(kernels):
    q4, q6, f16 = QuantType.Q4_K, QuantType.Q6_K, QuantType.F16
    assert kernels.supports(q4, q4, q6, 2048, 768, "silu")
    assert not kernels.supports(q4, q4, f16, 2048, 768, "silu")  # no kernel for the type
    assert not kernels.supports(q4, q4, q6, 2048, 700, "silu")  # rows not whole 256-blocks
    assert not kernels.supports(q4, q4, q6, 2048, 768, "swiglu_oai")
    g, u, d = _layer((QT.Q8_0,) * 3, 4, 256, 256, seed=0)
    x, w = torch.randn(1, 256), torch.ones(1, 2) / 2
    with pytest.raises(ValueError, match="expert ids outside"):
        kernels.moe_ffn(x, w, torch.tensor([[0, 4]]), g, u, d, (QuantType.Q8_0,) * 3)


def test_load_falls_back_to_none(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_compiler", lambda: "false")  # a "compiler" that always fails
    assert native.load(tmp_path / "a") is None
    monkeypatch.undo()
    monkeypatch.setattr(native, "self_check", lambda k: False)  # mis-compiled kernels
    assert native.load(tmp_path / "b") is None


def _tiny_native(tmp_path):
    """A tiny qwen3moe whose 256-wide Q8_0 experts the native kernels take: (gguf, model,
    its MoE blocks); the caller closes the gguf."""
    spec = replace(QWEN3MOE, dim=256, expert_ff=256, expert_qtype=QT.Q8_0)
    g = open_gguf(write_moe_gguf(tmp_path / "m.gguf", spec))
    model = build_model(g)
    return g, model, moe_blocks(model)


def test_tiny_cpu_moe_runs_on_native_kernels(kernels, tmp_path):
    """A CPU model whose expert format the native kernels take computes its experts there by
    default, holding no prepared copies: the same prompt scores like the torch path (prepared
    experts) within the int8 error, and bit-identically through host compute's entry point."""
    g, model, blocks = _tiny_native(tmp_path)
    try:
        assert all(b.native is not None for b in blocks)
        assert all(not b.source.prepared for b in blocks)  # raw blocks only
        gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
        prompt = [1, 5, 9, 33]  # 4 rows: within NATIVE_MAX_T, so host compute runs natively too
        got = gen.score(prompt)
        for b in blocks:
            b.compute_on_host(torch.device("cpu"), kernels)
        assert torch.equal(gen.score(prompt), got)
        assert sum(b.source.stats.host_rows for b in blocks) > 0
        for b in blocks:  # the torch path: prepared experts
            b.compute_on, b.native = None, None
            raw = {b.layer: tuple(w.data for w in b.expert_weights())}
            b.attach(ResidentExperts(raw, {b.layer: b.format}))
        want = gen.score(prompt)
        assert not torch.equal(got, want)  # the native kernels ran (int8 activations)
        assert _rel(got, want) < INT8_TOL
    finally:
        g.close()


def test_decode_rows_call_gives_moe_ffns_bits(kernels, tmp_path, monkeypatch):
    """Decode steps (up to ROWS_MAX_T rows) of a CPU model's resident native experts go through
    the prepared per-layer call; its logits equal moe_ffn's (the call switched off) bit for bit,
    for one row and for a few, and the resident source still counts every expert used."""
    from localllm.engine.moe import block as moe_mod

    g, model, blocks = _tiny_native(tmp_path)
    try:
        gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
        scores = {}
        for rows in (moe_mod.ROWS_MAX_T, 0):
            monkeypatch.setattr(moe_mod, "ROWS_MAX_T", rows)
            before = sum(b.source.stats.lookups for b in blocks)
            scores[rows] = [gen.score(p) for p in ([7], [1, 5, 9, 33, 2])]
            assert sum(b.source.stats.lookups for b in blocks) > before
        assert all(b._rows_call is not None for b in blocks)
        assert len({id(b.rows_scratch) for b in blocks}) == 1  # one scratch for the model
        for a, b in zip(*scores.values(), strict=True):
            assert torch.equal(a, b)
    finally:
        g.close()


def test_experts_fetched_in_chunks_give_the_same_bits(kernels):
    """A slot pool hands the kernels a few experts at a time: any chunking gives the bits of
    the whole layer in one call (pairs per chunk, one combine)."""
    rng = np.random.default_rng(5)
    dim, hidden, n_exp = 256, 256, 6
    types = (QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K)
    g = native.random_blocks(types[0], n_exp * hidden, dim, rng).reshape(n_exp, hidden, -1)
    u = native.random_blocks(types[1], n_exp * hidden, dim, rng).reshape(n_exp, hidden, -1)
    d = native.random_blocks(types[2], n_exp * dim, hidden, rng).reshape(n_exp, dim, -1)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, dim, generator=gen)
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:2] for _ in range(5)])
    w = torch.softmax(torch.randn(5, 2, generator=gen), -1)
    whole = kernels.moe_ffn(x, w, ids, g, u, d, types)
    calls = []

    def fetch(experts):
        calls.append(len(experts))
        return [(g[e], u[e], d[e]) for e in experts]

    for at_once in (1, 2, 4):
        calls.clear()
        got = kernels.moe_ffn_fetched(x, w, ids, fetch, types, at_once=at_once)
        assert torch.equal(got, whole), at_once
        assert max(calls) <= at_once and sum(calls) == len(set(ids.reshape(-1).tolist()))


@pytest.mark.parametrize("tokens", [2, 3, 5, 11])
def test_pairs_decoded_together_keep_each_pairs_bits(kernels, tokens):
    """A prompt's Q4_K (gate/up) and Q6_K (down) weight rows are decoded once for up to four
    pairs of the same expert (11 pairs: 4 + 4 + 3): every token's output equals the one it gets
    alone in a call (where each row meets one pair)."""
    types = (QT.Q4_K, QT.Q4_K, QT.Q6_K)
    qt = tuple(QuantType(t) for t in types)
    g, u, d = _layer(types, 3, 256, 512, seed=9)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, 256, generator=gen)
    ids = torch.tensor([[0, 2]] * tokens)  # every token's pairs in the same two experts
    w = torch.softmax(torch.randn(tokens, 2, generator=gen), -1)
    together = kernels.moe_ffn(x, w, ids, g, u, d, qt)
    alone = torch.cat([kernels.moe_ffn(x[i : i + 1], w[i : i + 1], ids[i : i + 1], g, u, d, qt)
                       for i in range(tokens)])  # fmt: skip
    assert together.abs().max() > 0 and torch.equal(together, alone)
