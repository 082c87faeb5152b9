"""Native CPU kernels: `moe_gemv.c` (its dot products in `quant_dots.h`) compiled at first use
with the system C compiler and loaded with ctypes (the calls release the GIL).

`load()` answers a `NativeKernels`, or None where no compiler, no OpenMP-less build either, or a
failed self-check (the kernels against dequantized float math on random blocks: a compiler that
mis-vectorizes is caught here, not in a user's tokens) leaves the torch paths in charge. It
carries the dense linears' kernels (`block_linear.py`, `NativeKernels.blocks`) where they load. The
library is cached on disk under a name hashed from the sources, the compiler and the flags, so a
later process only loads it. Float32 in, float32 out; Q4_K, Q6_K and Q8_0 weights whose row
length is a multiple of 256.
"""

import ctypes
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from localllm.kernels.cpu import block_linear
from localllm.kernels.cpu.cbuild import build_library, built_libraries, checked, compiler
from localllm.kernels.cpu.moe_prompt import expert_prompt_pairs
from localllm.kernels.moe.experts import ExpertFormat, expert_ffn_reference, group_by_expert
from localllm.kernels.quant import linear_native
from localllm.kernels.quant.types import QuantType

SOURCE = Path(__file__).with_name("moe_gemv.c")
HEADERS = (Path(__file__).with_name("quant_dots.h"),)  # included by SOURCE: part of the build key
TYPES = frozenset({QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0})
ACTS = {"silu": 0, "gelu": 1}
# fastest first; the last builds anywhere (no OpenMP: one thread)
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O2",),
)
CHECK_TOL = 0.1  # int8 activations: 0.7-2.4 % off (random experts); a wrong kernel: ~100 %

_P, _I, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


@dataclass(frozen=True)
class NativeKernels:
    lib: ctypes.CDLL
    path: Path
    flags: tuple[str, ...]
    blocks: "block_linear.BlockKernels | None" = None  # dense linears' kernels (`block_linear.c`)

    def supports(self, gate: QuantType, up: QuantType, down: QuantType, dim: int, hidden: int,
                 act: str) -> bool:  # fmt: skip
        """Whether `moe_ffn` computes experts of these types, sizes and activation."""
        types = {QuantType(gate), QuantType(up), QuantType(down)}
        return types <= TYPES and dim % 256 == 0 and hidden % 256 == 0 and act in ACTS

    def gemv(self, w: torch.Tensor, qtype: QuantType, n: int, k: int, x: torch.Tensor,
             threads: int | None = None) -> torch.Tensor:  # fmt: skip
        """Raw blocks w [n, row bytes] times x [k] -> float32 [n] (one matrix: tests, benches)."""
        x = x.float().contiguous().reshape(-1)
        y = torch.empty(n)
        q8, d8, bs = (
            torch.empty(k, dtype=torch.int8),
            torch.empty(k // 32),
            torch.empty(k // 16, dtype=torch.int16),
        )
        w = w.contiguous()
        self.lib.gemv(int(qtype), _ptr(w), n, k, _ptr(x), _ptr(y), _ptr(q8), _ptr(d8), _ptr(bs),
                      threads or torch.get_num_threads())  # fmt: skip
        return y

    def gemm_rows(self, w: torch.Tensor, qtype: QuantType, n: int, k: int, x: torch.Tensor,
                  threads: int | None = None) -> torch.Tensor:  # fmt: skip
        """Raw blocks w [n, row bytes] times a few rows x [t, k] -> float32 [t, n]: int8
        activations per 32, each weight row read once for all t rows (dense linears at decode)."""
        x = x.float().contiguous()
        t = x.shape[0]
        y = torch.empty(t, n)
        q8, d8, bs = quant_buffers(t * k)
        self.lib.gemm_rows(int(qtype), _ptr(w), n, k, t, _ptr(x), _ptr(y), _ptr(q8), _ptr(d8),
                           _ptr(bs), threads or torch.get_num_threads())  # fmt: skip
        return y

    def dequantize(self, w: torch.Tensor, qtype: QuantType, k: int,
                   threads: int | None = None) -> torch.Tensor:  # fmt: skip
        """Q4_K, Q6_K or Q8_0 rows w [rows, row bytes] (contiguous) -> float32 [rows, k] (ggml
        values)."""
        rows = w.shape[0]
        out = torch.empty(rows, k)
        self.lib.dequant_rows(int(qtype), _ptr(w), rows, k, _ptr(out),
                              threads or torch.get_num_threads())  # fmt: skip
        return out

    def moe_ffn(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        types: tuple[QuantType, QuantType, QuantType],
        act: str = "silu",
        threads: int | None = None,
    ) -> torch.Tensor:
        """Routed experts of one layer: x [T, dim], weights / ids [T, k], the layer's raw expert
        tensors gate / up [E, hidden, rb], down [E, dim, rb] (CPU) -> float32 [T, dim]."""
        n_expert = gate.shape[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_expert):
            raise ValueError(f"expert ids outside 0..{n_expert - 1}")
        g, u, d = (w.contiguous() for w in (gate, up, down))
        return self.moe_ffn_fetched(
            x, weights, ids, lambda es: [(g[e], u[e], d[e]) for e in es], types, act, threads
        )

    def moe_ffn_fetched(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        fetch,
        types: tuple[QuantType, QuantType, QuantType],
        act: str = "silu",
        threads: int | None = None,
        at_once: int | None = None,
    ) -> torch.Tensor:
        """`moe_ffn` over fetched experts: `fetch(experts)` -> each one's raw (gate, up, down)
        blocks ([hidden, rb], [hidden, rb], [dim, rb]; CPU, contiguous), valid together until
        the next call. At most `at_once` experts per fetch (a slot pool's size; None: all);
        their pairs go to the kernels per fetch, then one combine: the same bits whatever
        `at_once` is. Prompt rows (`linear_native.prompt_rows`) take the experts' int16 GEMMs
        (`moe_prompt`), the others the decode kernels."""
        rows = linear_native.current_prompt_rows()
        gemm = self.blocks is not None and linear_native.PROMPT_I16
        if gemm and isinstance(rows, torch.Tensor) and rows.numel() == x.shape[0] and rows.any():
            y = torch.empty(x.shape[0], x.shape[1])
            y[rows] = self._moe_prompt(x[rows], weights[rows], ids[rows], fetch, types, act,
                                       threads, at_once)  # fmt: skip
            if not rows.all():
                keep = ~rows
                y[keep] = self._moe_pairs(x[keep], weights[keep], ids[keep], fetch, types, act,
                                          threads, at_once)  # fmt: skip
            return y
        if gemm and rows is True:
            return self._moe_prompt(x, weights, ids, fetch, types, act, threads, at_once)
        return self._moe_pairs(x, weights, ids, fetch, types, act, threads, at_once)

    def _moe_prompt(self, x, weights, ids, fetch, types, act, threads, at_once) -> torch.Tensor:
        dim = x.shape[1]
        threads = threads or torch.get_num_threads()
        x = x.float().contiguous()

        def pairs_dn(tok, counts, blocks):  # experts of few rows: the decode kernels
            return self._pairs_dn(x, tok, counts, blocks, types, act, threads)

        dn, pos = expert_prompt_pairs(self.blocks.lib, x, ids, fetch, types, act, threads,
                                      at_once, pairs_dn)  # fmt: skip
        return self._combine(weights, ids, pos, dn, dim, threads)

    def _pairs_dn(self, x, tok, counts, blocks, types, act, threads) -> torch.Tensor:
        """`moe_pairs` over some experts' pairs: x [T, dim] float32 (contiguous), tok [pairs]
        each pair's token row, grouped by expert (counts, blocks: each expert's) -> [pairs, dim]."""
        t, dim = x.shape
        pairs, hidden = tok.shape[0], blocks[0][0].shape[0]
        xq, xd, xb = quant_buffers(t * dim)
        two = (types[0] == QuantType.Q4_K) != (types[1] == QuantType.Q4_K)
        kq, kd, kb = quant_buffers(t * dim) if two else (xq, xd, xb)
        h, dn = torch.empty(pairs * 2 * hidden), torch.empty(pairs, dim)
        aq, ad, ab = quant_buffers(pairs * hidden)
        ptrs = [(ctypes.c_void_p * len(blocks))(*(_ptr(b[i]) for b in blocks)) for i in range(3)]
        gstart = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
        tok = tok.contiguous()
        self.lib.moe_pairs(
            t, len(blocks), _ptr(gstart), *ptrs, _ptr(tok), _ptr(x), *(int(q) for q in types), dim,
            hidden, ACTS[act], _ptr(xq), _ptr(xd), _ptr(xb), _ptr(kq), _ptr(kd), _ptr(kb), _ptr(h),
            _ptr(aq), _ptr(ad), _ptr(ab), _ptr(dn), threads,
        )  # fmt: skip
        return dn

    def _moe_pairs(self, x, weights, ids, fetch, types, act, threads, at_once) -> torch.Tensor:
        t, dim = x.shape
        kk = ids.shape[1]
        x = x.float().contiguous()
        threads = threads or torch.get_num_threads()
        order, used, counts = group_by_expert(ids.to(torch.int64))
        bounds = [0, *itertools.accumulate(counts)]
        tok = order // kk
        dn = torch.empty(t * kk, dim)
        step = at_once or len(used) or 1
        for c0 in range(0, len(used), step):
            chunk = used[c0 : c0 + step]
            a, b = bounds[c0], bounds[c0 + len(chunk)]
            dn[a:b] = self._pairs_dn(x, tok[a:b], counts[c0 : c0 + len(chunk)], fetch(chunk),
                                     types, act, threads)  # fmt: skip
        pos = torch.empty_like(order)
        pos[order] = torch.arange(t * kk)
        return self._combine(weights, ids, pos, dn, dim, threads)

    def _combine(self, weights, ids, pos, dn, dim: int, threads: int) -> torch.Tensor:
        """Each row's choices summed in their order, weighted: [T, dim]."""
        t, kk = ids.shape
        y = torch.empty(t, dim)
        wts, pos = weights.float().contiguous(), pos.contiguous()
        self.lib.moe_combine(t, kk, _ptr(pos), _ptr(wts), _ptr(dn), dim, _ptr(y), threads)
        return y


def quant_buffers(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch for n activations quantized by the kernels: int8 codes, a scale per 32, and
    int16 sums per 16."""
    return (
        torch.empty(n, dtype=torch.int8),
        torch.empty(n // 32),
        torch.empty(n // 16, dtype=torch.int16),
    )


def _compiler() -> str | None:
    return compiler()


def _build(cc: str, flags: tuple[str, ...], out_dir: Path) -> Path | None:
    return build_library(cc, flags, (SOURCE, *HEADERS), "localllm-moe-gemv", out_dir)


def _bind(lib: ctypes.CDLL) -> None:
    lib.gemv.argtypes = [_INT, _P, _I, _I, _P, _P, _P, _P, _P, _INT]
    lib.gemv.restype = None
    lib.moe_pairs.argtypes = [_I, _I, _P, _P, _P, _P, _P, _P, _INT, _INT, _INT, _I, _I, _INT,
                              _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _INT]  # fmt: skip
    lib.moe_pairs.restype = None
    lib.gemm_rows.argtypes = [_INT, _P, _I, _I, _I, _P, _P, _P, _P, _P, _INT]
    lib.gemm_rows.restype = None
    lib.dequant_rows.argtypes = [_INT, _P, _I, _I, _P, _INT]
    lib.dequant_rows.restype = None
    lib.moe_combine.argtypes = [_I, _I, _P, _P, _P, _I, _P, _INT]
    lib.moe_combine.restype = None
    lib.flag_wait.argtypes = [_P, ctypes.c_int32, _I]
    lib.flag_wait.restype = _INT
    lib.flag_set.argtypes = [_P, ctypes.c_int32]
    lib.flag_set.restype = None
    lib.split_run.argtypes = [_P, _I, ctypes.c_int32, _I, _INT]
    lib.split_run.restype = _I


def load(cache_dir: Path | None = None) -> NativeKernels | None:
    """The compiled kernels, checked, or None (then callers keep their torch paths)."""
    cc = _compiler()
    if cc is None:
        return None
    sources = (SOURCE, *HEADERS)
    for lib, path, flags in built_libraries(sources, FLAG_SETS, "localllm-moe-gemv", _bind,
                                            cache_dir, cc):  # fmt: skip
        kernels = NativeKernels(lib, path, flags, block_linear.load(cache_dir))
        if checked(path, lambda: self_check(kernels)):  # noqa: B023 (called at once)
            return kernels
    return None


def self_check(k: NativeKernels, seed: int = 0) -> bool:
    """Every kernel on random blocks against dequantized float math (relative error)."""
    rng = np.random.default_rng(seed)
    dim, hidden, n_exp = 256, 512, 3
    gen = torch.Generator().manual_seed(seed)
    for types in ((QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K), (QuantType.Q8_0,) * 3):
        raws = [
            random_blocks(types[0], n_exp * hidden, dim, rng).reshape(n_exp, hidden, -1),
            random_blocks(types[1], n_exp * hidden, dim, rng).reshape(n_exp, hidden, -1),
            random_blocks(types[2], n_exp * dim, hidden, rng).reshape(n_exp, dim, -1),
        ]
        x = torch.randn(2, dim, generator=gen)
        ids = torch.tensor([[0, 2], [1, 0]])
        wts = torch.tensor([[0.7, 0.3], [0.4, 0.6]])
        got = k.moe_ffn(x, wts, ids, *raws, types, threads=2)
        want = expert_ffn_reference(x, wts, ids, *raws, ExpertFormat(*types, dim, hidden))
        err = ((got.double() - want).norm() / want.norm()).item()
        if not err < CHECK_TOL:
            return False
    return True


def random_blocks(qtype: QuantType, rows: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [rows, row bytes] of random blocks with small finite fp16 scales."""
    qtype = QuantType(qtype)
    nbytes = {QuantType.Q4_K: 144, QuantType.Q6_K: 210, QuantType.Q8_0: 34}[qtype]
    per = 256 if qtype != QuantType.Q8_0 else 32
    nb = rows * k // per
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    small = (rng.uniform(0.5, 1.5, nb) * 1e-2).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if qtype == QuantType.Q8_0:
        raw[:, 0:2] = small
    elif qtype == QuantType.Q4_K:
        raw[:, 0:2] = small
        raw[:, 2:4] = small
    else:
        raw[:, 208:210] = small
    return torch.from_numpy(raw.reshape(rows, -1))
