"""A GLM-4.5-Air-shaped MoE block on a GPU: its experts are packed for the dp4a kernels, so its
decode step is graph-safe, even where llama.cpp's Q4_K_M wrote `ffn_down_exps` as Q5_0 (rows
of 1408, no whole 256-value K block). Before, such a layer kept raw blocks: per-expert host
loops, no CUDA graphs (issue 40: tg128 33 t/s against llama.cpp's 520 on an H100).

Runs on CUDA (marked `gpu`) or on CPU tensors under TRITON_INTERPRET=1 (the block is "moved"
to the CPU there, which packs exactly as a GPU does). Tolerance as in test_moe_packed: the
whole FFN against the float oracle 5e-2 relative (activations rounded to int8 twice)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.moe.block import MoEFeedForward, Routing, graph_safe
from localllm.kernels.moe import expert_ffn_reference, route_scored
from localllm.kernels.quant import QuantType
from localllm.offload import QuantWeight
from tests.perf.make_synthetic import random_rows
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS

E, K_USED, D, H = 8, 2, 256, 288  # H: 9 blocks of 32, no whole K block (GLM-4.5-Air: 1408)


def _experts(qt: QT, rows: int, cols: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    raw = torch.from_numpy(np.stack([random_rows(qt, rows, cols, rng) for _ in range(E)]))
    return QuantWeight(raw, QuantType[qt.name], (E, rows, cols))


@pytest.mark.parametrize("down", ["Q5_0", "Q8_0"])
@pytest.mark.parametrize("tokens", [1, 12])
def test_glm_air_block_packs_its_experts(down, tokens):
    routing = Routing(scoring="sigmoid", probs_bias=True)
    b = MoEFeedForward(1, D, H, E, K_USED, norm_topk_prob=True, routing=routing)
    g, u = _experts(QT.Q4_K, H, D, 1), _experts(QT.Q4_K, H, D, 2)
    d = _experts(QT[down], D, H, 3)
    for t, w in zip((b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps), (g, u, d), strict=True):
        t.load_tensor("weight", w)
    b.fuse()
    b._to_device(torch.device(DEVICE))  # what `fuse` does for experts whose home is a GPU
    assert b.packed is not None and graph_safe(b)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, D, generator=gen)
    bias = 0.1 * torch.randn(E, generator=gen)
    w, ids = route_scored(torch.randn(tokens, E, generator=gen), K_USED, "sigmoid", bias)
    got = b.forward_routed(x.to(DEVICE), None, w.to(DEVICE), ids.to(DEVICE)).cpu()
    want = expert_ffn_reference(x, w, ids, g.data, u.data, d.data, b.format)
    assert got.shape == (tokens, D) and want.abs().max() > 0.05
    rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert rel < 5e-2


def _glm_block(down: QT) -> tuple[MoEFeedForward, list[QuantWeight]]:
    routing = Routing(scoring="sigmoid", probs_bias=True)
    b = MoEFeedForward(1, D, H, E, K_USED, norm_topk_prob=True, routing=routing)
    ws = [_experts(QT.Q4_K, H, D, 1), _experts(QT.Q4_K, H, D, 2), _experts(down, D, H, 3)]
    for t, w in zip((b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps), ws, strict=True):
        t.load_tensor("weight", w)
    b.fuse()
    b._to_device(torch.device(DEVICE))
    return b, ws


@pytest.mark.parametrize("tokens", [1, 12])
def test_native_q5_0_block_equals_the_widened_bit_for_bit(tokens, monkeypatch):
    """`widen.NATIVE_Q5_0`: the block packs its Q5_0 down experts as they are (fewer bytes),
    decode (grouped GEMVs) and prompt (grouped GEMMs) rows equal the widened block's."""
    from localllm.kernels.quant import widen

    wide, _ = _glm_block(QT.Q5_0)
    monkeypatch.setattr(widen, "NATIVE_Q5_0", True)
    mine, _ = _glm_block(QT.Q5_0)
    assert wide.packed.down.qtype == QuantType.Q8_0 and mine.packed.down.qtype == QuantType.Q5_0
    assert mine.packed.down.nbytes * 34 == wide.packed.down.nbytes * 22 and graph_safe(mine)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, D, generator=gen).to(DEVICE)
    w, ids = route_scored(torch.randn(tokens, E, generator=gen), K_USED, "sigmoid", None)
    w, ids = w.to(DEVICE), ids.to(DEVICE)
    assert torch.equal(mine.forward_routed(x, None, w, ids), wide.forward_routed(x, None, w, ids))


def test_shared_expert_rides_with_the_deferred_rows(monkeypatch):
    """`moe.block.SHARED_IN_NORM`: a decode row of a block with a shared expert (GLM-4.5-Air's
    layout) comes back unsummed, the shared output as its `extra`; summed (`total`, what the
    next norm's kernel adds on CUDA: tests/kernels/test_fused.py) it is the block's output
    without the switch, bit for bit."""
    from localllm.engine.moe import block as moe_block
    from localllm.kernels.fused import WeightedRows

    sh = 64
    routing = Routing(scoring="sigmoid", probs_bias=True)
    b = MoEFeedForward(1, D, H, E, K_USED, norm_topk_prob=True, routing=routing, shared_hidden=sh)
    ws = [_experts(QT.Q4_K, H, D, 1), _experts(QT.Q4_K, H, D, 2), _experts(QT.Q5_0, D, H, 3)]
    for t, w in zip((b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps), ws, strict=True):
        t.load_tensor("weight", w)
    rng = np.random.default_rng(4)
    for name, (rows, cols) in (("ffn_gate", (sh, D)), ("ffn_up", (sh, D)), ("ffn_down", (D, sh))):
        raw = torch.from_numpy(random_rows(QT.Q8_0, rows, cols, rng))
        getattr(b.shexp, name).load_tensor("weight", QuantWeight(raw, QuantType.Q8_0, (rows, cols)))
    b.fuse()
    b._to_device(torch.device(DEVICE))
    b.sum_in_norm = True
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, D, generator=gen).to(DEVICE)
    w, ids = route_scored(torch.randn(2, E, generator=gen), K_USED, "sigmoid", None)
    w, ids = w.to(DEVICE), ids.to(DEVICE)
    plain = b.forward_routed(x, None, w, ids)
    assert isinstance(plain, torch.Tensor)  # (off: shared experts keep the layer summed)
    monkeypatch.setattr(moe_block, "SHARED_IN_NORM", True)
    pending = b.forward_routed(x, None, w, ids)
    assert isinstance(pending, WeightedRows) and pending.extra is not None
    assert torch.equal(pending.total(), plain)
