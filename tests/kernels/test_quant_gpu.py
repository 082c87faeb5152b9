"""The dequant references and the generic linear path on a CUDA device (run on the GPU machine).

The references are plain torch, so on CUDA they must give the CPU's bits exactly: every step is
a separate elementwise op (nothing for the compiler to fuse into an FMA).
"""

import zlib

import numpy as np
import pytest
import torch

from localllm.kernels.quant import (
    DEQUANT_TYPES,
    QuantType,
    block_geometry,
    dequantize,
    prepare_linear,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", sorted(t.name for t in DEQUANT_TYPES))
def test_cuda_dequant_equals_cpu(name, make_blocks):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    raw = torch.from_numpy(np.array(make_blocks(name, 64, 4, rng)))
    cpu = dequantize(raw, QuantType[name])
    gpu = dequantize(raw.cuda(), QuantType[name])
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu().view(torch.int32), cpu.view(torch.int32))


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "IQ2_XS"])
def test_cuda_linear_matches_cpu_reference(name, make_blocks):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    qtype, shape = QuantType[name], (64, 512)
    raw = torch.from_numpy(np.array(make_blocks(name, 64, 512 // block_geometry(qtype)[0], rng)))
    x = torch.randn(5, 512)
    ref = x @ dequantize(raw, qtype).reshape(shape).T
    exact = prepare_linear(raw.cuda(), qtype, shape, precise=True).matmul(x.cuda()).cpu()
    assert ((exact - ref).norm() / ref.norm()).item() < 1e-5
    # The default CUDA policy multiplies Q4_K / Q8_0 decode rows with int8 activations per 32
    # (the dp4a GEMVs, as llama.cpp's mmvq): 5.2e-3 / 5.4e-3 from exact on an H100 (2026-12-06)
    y = prepare_linear(raw.cuda(), qtype, shape).matmul(x.cuda()).cpu()
    assert ((y - ref).norm() / ref.norm()).item() < (2e-2 if name in ("Q4_K", "Q8_0") else 1e-5)
