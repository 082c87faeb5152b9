"""The batched-decode GEMMs over packed blocks (`kernels.quant.batch_gemm`): 9-64 activation rows
times a packed Q4_K / Q6_K / Q8_0 weight, the weight tiles expanded in registers.

Two references, both float64: the bf16 copy of the weight this path replaces
(`dequantize_packed_t`, the same rounding of each value on the same device), which the kernel
must equal up to float32 summation (`SUM_TOL`: 1e-6 under the interpreter; 5e-5 on CUDA, whose
tensor cores add products of up to 14,336 values in their own order and precision); and gguf's
dequantization rounded to bf16 (`batch_gemm_reference`): `SUM_TOL` on CUDA, 8e-3 under the
interpreter, whose float32 -> bf16 conversion truncates
(`test_triton_packed.test_dequantize_packed_t`). Either is far below what another path gives
(int8 activations ~5e-3; a bf16 output ~2e-3). Split-K geometries,
uneven last splits and row counts that are not a tile's are covered. Kernels run on CUDA
(marked `gpu`) or on CPU tensors under TRITON_INTERPRET=1.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.kernels.quant import QuantType
from localllm.kernels.quant.repack import pack_blocks
from tests.perf.make_synthetic import random_rows
from tests.triton_env import DEVICE, INTERPRET, TRITON_MARKS

pytestmark = TRITON_MARKS

# (type, N, K): K of 5 super-blocks (Q4_K, Q6_K) or 40 blocks (Q8_0) splits unevenly
SUM_TOL = 1e-6 if INTERPRET else 5e-5
# (type, N, K, rows); on CUDA also Llama-3-8B layer shapes at 16 and 64 rows (their gguf
# reference dequantizes on the CPU: a few seconds each)
SMALL = [("Q4_K", 70, 1280), ("Q6_K", 70, 1280), ("Q8_0", 70, 1280)]
CASES = [(*c, m) for c in SMALL for m in (9, 16, 23, 64)]
if not INTERPRET:
    BIG = [("Q4_K", 4096, 4096), ("Q6_K", 4096, 14336), ("Q8_0", 6144, 4096)]
    CASES += [(*c, m) for c in BIG for m in (16, 64)]


def _packed(name: str, n: int, k: int, seed: int):
    raw = torch.from_numpy(random_rows(QT[name], n, k, np.random.default_rng(seed)))
    return pack_blocks(raw.reshape(n, -1).to(DEVICE), QuantType[name], n, k)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("name", "n", "k", "m"), CASES)
def test_batch_gemm_equals_the_bf16_copy_and_gguf(name, n, k, m):
    from localllm.kernels.quant.batch_gemm import batch_gemm, batch_gemm_reference
    from localllm.kernels.quant.triton_packed import dequantize_packed_t

    p = _packed(name, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    y = batch_gemm(x, p)
    assert y.shape == (m, n) and y.dtype == torch.float32
    copy = x.bfloat16().double() @ dequantize_packed_t(p).double()
    assert _rel(y, copy) < SUM_TOL
    assert _rel(y, batch_gemm_reference(x, p)) < (8e-3 if INTERPRET else SUM_TOL)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_split_k_geometries_give_the_same_sums(name):
    """One split, uneven splits (5 super-blocks in 2 + 2 + 1) and narrow tiles: each equals the
    bf16 copy; their partial sums differ only in float32 order."""
    from localllm.kernels.quant.batch_gemm import BatchGemmConfig, batch_gemm, splits
    from localllm.kernels.quant.triton_packed import dequantize_packed_t

    n, k, m = 70, 1280, 12
    p = _packed(name, n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    copy = x.bfloat16().double() @ dequantize_packed_t(p).double()
    one = BatchGemmConfig(target_programs=1)
    uneven = BatchGemmConfig(block_n=32, target_programs=9, min_blocks=1)
    assert splits(p, m, one)[0] == 1
    n_split, per = splits(p, m, uneven)
    assert n_split > 1 and (p.k // (32 if name == "Q8_0" else 256)) % per != 0
    for cfg in (one, uneven, BatchGemmConfig(block_n=16, warps=2)):
        assert _rel(batch_gemm(x, p, cfg), copy) < SUM_TOL, cfg


def test_rejects_rows_it_does_not_take():
    from localllm.kernels.quant.batch_gemm import MAX_ROWS, batch_gemm

    p = _packed("Q8_0", 16, 256, seed=0)
    with pytest.raises(ValueError, match="batch_gemm takes"):
        batch_gemm(torch.zeros(MAX_ROWS + 1, 256, device=DEVICE), p)
    with pytest.raises(ValueError, match="batch_gemm takes"):
        batch_gemm(torch.zeros(4, 128, device=DEVICE), p)
