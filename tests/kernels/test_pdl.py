"""Programmatic dependent launch (`kernels/pdl.py`): a chain of dependent decode kernels gives
the same bits with PDL as without it, eagerly and replayed from a CUDA graph, many times over.

A kernel that touched its predecessor's output before `gdc_wait` would read stale or half-written
values in some replays; comparing every replay bit for bit against the chain launched without PDL
is what catches that. Needs an sm_90+ GPU (marked `gpu`); PDL is off elsewhere.
"""

import numpy as np
import pytest
import torch

from localllm.kernels.quant import QuantType
from localllm.kernels.quant.repack import pack_blocks

CUDA9 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA9, reason="needs an sm_90+ GPU")]

D, H = 2048, 3072  # model width, MLP width (small enough to run in a second)


def _weights(make_blocks, layers: int):
    rng = np.random.default_rng(7)
    out = []
    for _ in range(layers):
        mats = []
        for name, n, k in (("Q4_K", 2 * H, D), ("Q6_K", D, H), ("Q8_0", D, D)):
            block = 32 if name == "Q8_0" else 256
            raw = torch.from_numpy(make_blocks(name, n, k // block, rng)).reshape(n, -1)
            mats.append(pack_blocks(raw.cuda(), QuantType[name], n, k))
        out.append(mats)
    return out


def _chain(x, norm_w, mats):
    """Per layer: add+RMSNorm (quantized twin) -> gate_up GEMV -> SiLU x up (quantized) -> down
    GEMV -> add+RMSNorm -> a Q8_0 GEMV fed by a separate quantization launch."""
    from localllm.kernels.fused.triton_ops import add_rms_norm_cuda, silu_mul_cuda
    from localllm.kernels.quant.triton_packed import gemv_packed

    h = torch.zeros_like(x)
    for gate_up, down, proj in mats:
        s, y, yq = add_rms_norm_cuda(x, h, norm_w, 1e-5, quant=True)
        a, aq = silu_mul_cuda(gemv_packed(y, gate_up, xq=yq), H, quant=True)
        h = gemv_packed(a, down, xq=aq)
        s2, y2, _ = add_rms_norm_cuda(s, h, norm_w, 1e-5, quant=False)
        x, h = s2, gemv_packed(y2, proj) * 1e-2
    return x + h


def test_pdl_chain_is_bit_exact_eager_and_in_graphs(make_blocks, monkeypatch):
    from localllm.kernels import pdl  # triton: only where a GPU is

    assert pdl.enabled(torch.empty(1, device="cuda"))
    mats = _weights(make_blocks, 4)
    norm_w = torch.rand(D, device="cuda") + 0.5
    x = torch.randn(2, D, device="cuda")
    with monkeypatch.context() as m:
        m.setattr(pdl, "enabled", lambda t: False)
        ref = _chain(x, norm_w, mats)
    torch.cuda.synchronize()
    assert torch.isfinite(ref).all()
    for _ in range(5):
        assert torch.equal(_chain(x, norm_w, mats), ref)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(static_x, norm_w, mats)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static_x, norm_w, mats)
    for i in range(50):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"replay {i}"
