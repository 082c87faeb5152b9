"""Native linears over the file's quantized blocks: `block_linear.c` (its dots in `block_dots.h`
and `quant_dots.h`, its dequantization in `block_dequant.h`) compiled at first use with the
system C compiler and loaded with ctypes (the calls release the GIL).

`load()` answers a `BlockKernels`, or None where no compiler or a failed self-check (every type's
values against the torch dequantization, its dots against float math on those values, on random
blocks) leaves the torch paths in charge. Float32 in, float32 out. A weight is one or more parts,
uint8 [rows, row bytes] each (a fused projection's tensors as the file holds them, never
stacked); `Parts` keeps their addresses for the calls.
"""

import ctypes
import threading
from pathlib import Path

import numpy as np
import torch

from localllm.kernels.cpu.cbuild import built_libraries, checked, compiler
from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.linear_native import MAX_PARTS, NATIVE_TYPES
from localllm.kernels.quant.types import QuantType, block_geometry

HERE = Path(__file__).parent
SOURCES = (HERE / "block_linear.c", HERE / "block_dequant.h", HERE / "block_dots.h",
           HERE / "quant_dots.h", HERE / "i16_gemm.h", HERE / "i8_gemm.h")  # fmt: skip
TYPES = NATIVE_TYPES  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, IQ4_XS, Q4_K, Q5_K, Q6_K
FLAG_SETS = (  # fastest first; the last builds anywhere (no OpenMP: one thread)
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O2",),
)
CHECK_TOL = 0.05  # int8 activations: ~0.5-1.5 % off on random blocks; a wrong kernel: ~100 %
# byte offsets of each block's fp16 scales (ggml's block structs): set small in random blocks
_F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
           "IQ4_XS": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip

_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class Parts:
    """The parts of one weight (uint8 [rows_i, row bytes], contiguous; kept alive here) as the C
    calls take them: an array of addresses and one of row counts."""

    def __init__(self, parts: list[torch.Tensor]):
        if not 0 < len(parts) <= MAX_PARTS:
            raise ValueError(f"{len(parts)} parts: 1 to {MAX_PARTS}")
        self.parts = [p.contiguous() for p in parts]
        self.ptrs = (ctypes.c_void_p * len(parts))(*(p.data_ptr() for p in self.parts))
        self.rows = (ctypes.c_int64 * len(parts))(*(p.shape[0] for p in self.parts))
        self.n = sum(p.shape[0] for p in self.parts)

    def __len__(self) -> int:
        return len(self.parts)


class BlockKernels:
    def __init__(self, lib: ctypes.CDLL, path: Path, flags: tuple[str, ...]):
        self.lib, self.path, self.flags = lib, path, flags
        self._local = threading.local()  # activation scratch per thread: the calls drop the GIL

    def parts(self, tensors: list[torch.Tensor]) -> Parts:
        """`Parts` of a weight for these kernels' calls."""
        return Parts(tensors)

    def supports(self, qtype: QuantType, k: int) -> bool:
        """Whether rows of k values of `qtype` go through these kernels."""
        qtype = QuantType(qtype)
        return qtype in TYPES and k % block_geometry(qtype)[0] == 0 and k % 32 == 0

    def _quant_scratch(self, n: int) -> tuple:
        # int8 codes, a scale per 32 and sums per 16 of n activations; grown to the largest call
        have = getattr(self._local, "scratch", (0, ()))
        if have[0] < n:
            have = (n, (torch.zeros(n, dtype=torch.int8), torch.zeros(n // 32 + 8),
                        torch.zeros(n // 16 + 16, dtype=torch.int16)))  # fmt: skip
            self._local.scratch = have
        return have[1]

    def rows(self, parts: Parts, qtype: QuantType, k: int, x: torch.Tensor,
             threads: int | None = None) -> torch.Tensor:  # fmt: skip
        """x [t, k] float32 (contiguous) -> [t, n] float32 through int8 activations."""
        t = x.shape[0]
        y = torch.empty(t, parts.n)
        q8, d8, bs = self._quant_scratch(t * k)
        self.lib.block_rows(int(qtype), len(parts), parts.ptrs, parts.rows, k, t, x.data_ptr(),
                            y.data_ptr(), q8.data_ptr(), d8.data_ptr(), bs.data_ptr(),
                            threads or torch.get_num_threads())  # fmt: skip
        return y

    def gemm_i16(self, parts: Parts, qtype: QuantType, k: int, x: torch.Tensor,
                 threads: int | None = None) -> torch.Tensor:  # fmt: skip
        """x [t, k] float32 (contiguous) -> [t, n] float32 through int16 activations
        (i16_gemm.h; `gemm_i16_reference` is its math in torch)."""
        y = torch.empty(x.shape[0], parts.n)
        rc = self.lib.block_gemm_i16(int(qtype), len(parts), parts.ptrs, parts.rows, k,
                                     x.shape[0], x.data_ptr(), y.data_ptr(),
                                     threads or torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise MemoryError(f"int16 GEMM {x.shape[0]} x {k}: no memory (or k % 32 != 0)")
        return y

    def gemm_i8(self, parts: Parts, qtype: QuantType, k: int, x: torch.Tensor,
                threads: int | None = None) -> torch.Tensor:  # fmt: skip
        """x [t, k] float32 (contiguous) -> [t, n] float32 through int8 activations in llama.cpp's
        format for `qtype` (i8_gemm.h; `kernels.quant.prompt_i8.gemm_i8_reference` is its math)."""
        y = torch.empty(x.shape[0], parts.n)
        rc = self.lib.block_gemm_i8(int(qtype), len(parts), parts.ptrs, parts.rows, k,
                                    x.shape[0], x.data_ptr(), y.data_ptr(),
                                    threads or torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise MemoryError(f"int8 GEMM {x.shape[0]} x {k} of {QuantType(qtype).name}: no memory "
                              "(or k not a multiple of its group)")  # fmt: skip
        return y

    def dequant(self, parts: Parts, qtype: QuantType, k: int, r0: int, r1: int,
                threads: int | None = None) -> torch.Tensor:  # fmt: skip
        """Rows r0 .. r1 - 1 of the parts' row space as ggml's float32 values [r1 - r0, k]."""
        out = torch.empty(r1 - r0, k)
        self.lib.block_dequant(int(qtype), len(parts), parts.ptrs, parts.rows, r0, r1 - r0, k,
                               out.data_ptr(), threads or torch.get_num_threads())  # fmt: skip
        return out


def _bind(lib: ctypes.CDLL) -> None:
    lib.block_rows.argtypes = [_INT, _I, _P, _P, _I, _I, _P, _P, _P, _P, _P, _INT]
    lib.block_rows.restype = None
    lib.block_gemm_i16.argtypes = [_INT, _I, _P, _P, _I, _I, _P, _P, _INT]
    lib.block_gemm_i16.restype = _INT
    lib.block_gemm_i8.argtypes = [_INT, _I, _P, _P, _I, _I, _P, _P, _INT]
    lib.block_gemm_i8.restype = _INT
    lib.block_dequant.argtypes = [_INT, _I, _P, _P, _I, _I, _I, _P, _INT]
    lib.block_dequant.restype = None


def load(cache_dir: Path | None = None) -> BlockKernels | None:
    """The compiled kernels, checked, or None (then callers keep their torch paths)."""
    cc = compiler()
    if cc is None:
        return None
    for lib, path, flags in built_libraries(SOURCES, FLAG_SETS, "localllm-block-linear", _bind,
                                            cache_dir, cc):  # fmt: skip
        kernels = BlockKernels(lib, path, flags)
        if checked(path, lambda: self_check(kernels)):  # noqa: B023 (called at once)
            return kernels
    return None


def random_blocks(qtype: QuantType, rows: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [rows, row bytes] of random blocks of `qtype` with small finite scales."""
    qtype = QuantType(qtype)
    block, nbytes = block_geometry(qtype)
    nb = rows * k // block
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    for at in _F16_AT.get(qtype.name, ()):
        small = (rng.uniform(0.5, 1.5, nb) * 1e-2).astype(np.float16).view(np.uint8)
        raw[:, at : at + 2] = small.reshape(nb, 2)
    if qtype == QuantType.MXFP4:  # E8M0 scales 2^-10 .. 2^-5 (x the doubled E2M1 values)
        raw[:, 0] = rng.integers(118, 124, nb, dtype=np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def self_check(k: BlockKernels, seed: int = 0) -> bool:
    """Each type's values equal the torch dequantization; its dots on 5 rows over two parts are
    within CHECK_TOL of float math on those values (int8 rows, int16 and int8 GEMMs), and one row
    alone gets the same bits."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    n, kk = 24, 512
    for qtype in sorted(TYPES):
        raw = random_blocks(qtype, n, kk, rng)
        parts = Parts([raw[:10], raw[10:]])
        w = dequantize(raw, qtype).reshape(n, kk)
        if not torch.equal(k.dequant(parts, qtype, kk, 0, n, threads=2), w):
            return False
        x = torch.randn(5, kk, generator=gen)
        got = k.rows(parts, qtype, kk, x, threads=2)
        want = x.double() @ w.double().T
        if not ((got.double() - want).norm() / want.norm()).item() < CHECK_TOL:
            return False
        if not torch.equal(k.rows(parts, qtype, kk, x[3:4].contiguous(), threads=1), got[3:4]):
            return False
        wide = k.gemm_i16(parts, qtype, kk, x, threads=2)  # int16 x: ~2e-5 off
        if not ((wide.double() - want).norm() / want.norm()).item() < CHECK_TOL:
            return False
        narrow = k.gemm_i8(parts, qtype, kk, x, threads=2)  # int8 x, as the rows
        if not ((narrow.double() - want).norm() / want.norm()).item() < CHECK_TOL:
            return False
    return True
