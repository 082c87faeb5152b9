"""LoRA deltas inside the native CPU decode step (`decode_step.c`'s `lora_t`, `set_lora`): each
block linear's adapters as float16 A [r, in] and, per output part, B.T [hi - lo, n] at its column
(float32 math), and the rows' adapter factors W [rows, r]; `LoraTable` holds one step's table (4
per layer: q|k|v, o, gate|up, down) and keeps its tensors alive. The torch reference is
`engine.lora.delta`'s own ops (tests/lora/test_lora_native.py holds the step to them).

B.T is row-major [hi - lo, n] for a library as it is, or chunk-major [ceil(n / 64), hi - lo, 64]
(zero-padded) for one that exports `lora_chunk_major`: each expand work item (64 output columns)
then reads one contiguous block instead of 64 rows a stride apart. On the 2-core Zen 3 box the
strided reads, not the math or the Python side, were two thirds of four rank-16 adapters' cost
(tests/perf/bench_lora_add.c; tests/perf/results/lora.md).
"""

import ctypes
from dataclasses import dataclass

import torch

from localllm.kernels.cpu.decode_step import MAX_GROUPS

_I, _P = ctypes.c_int64, ctypes.c_void_p
LINEARS = 4  # per layer, in the C's order: q|k|v, o, gate|up, down
CHUNK = 64  # the C's LORA_CHUNK: output columns of one expand work item


class _Lora(ctypes.Structure):
    _fields_ = [("r", _I), ("nseg", _I), ("a", _P), ("w", _P), ("tmp", _P),
                ("lo", _I * MAX_GROUPS), ("hi", _I * MAX_GROUPS), ("col", _I * MAX_GROUPS),
                ("n", _I * MAX_GROUPS), ("bt", _P * MAX_GROUPS)]  # fmt: skip


@dataclass(frozen=True, slots=True)
class LinearLora:
    """One block linear's adapters: a [r, in], w [rows, r] (each row's factor per column), and
    per output part (first column lo, past-last hi, its output column, B.T [hi - lo, n])."""

    a: torch.Tensor
    w: torch.Tensor
    parts: tuple[tuple[int, int, int, torch.Tensor], ...]


class LoraTable:
    """A step's `lora_t` table over `linears` [n_layers * LINEARS] (None: that linear has none)."""

    def __init__(self, linears: list[LinearLora | None], max_rows: int):
        if len(linears) % LINEARS:
            raise ValueError(f"{len(linears)} linears: {LINEARS} per layer")
        self.keep: list[torch.Tensor] = []
        self.structs: list[_Lora | None] = []
        self.chunked = False  # B.T laid out chunk-major (`to_chunks`)
        self._bts: list[tuple[_Lora, int, torch.Tensor]] = []  # (struct, part, row-major B.T)
        for lin in linears:
            self.structs.append(None if lin is None else self._struct(lin, max_rows))
        self.table = (_P * len(linears))(
            *(None if s is None else ctypes.addressof(s) for s in self.structs)
        )

    def _struct(self, lin: LinearLora, max_rows: int) -> _Lora:
        r = lin.a.shape[0]
        if len(lin.parts) > MAX_GROUPS or lin.w.shape[1] != r or lin.w.shape[0] < max_rows:
            raise ValueError("a LoRA linear the native step cannot take")
        a = lin.a.half().contiguous()
        w = lin.w if lin.w.dtype == torch.float32 and lin.w.is_contiguous() else None
        if w is None:
            raise ValueError("LoRA row factors must be a contiguous float32 [rows, r]")
        tmp = torch.zeros(max_rows * r)
        bts = [bt.half().contiguous() for *_, bt in lin.parts]
        self.keep += [a, w, tmp, *bts]
        s = _Lora(r, len(lin.parts), a.data_ptr(), w.data_ptr(), tmp.data_ptr())
        for i, ((lo, hi, col, _), bt) in enumerate(zip(lin.parts, bts, strict=True)):
            s.lo[i], s.hi[i], s.col[i], s.n[i] = lo, hi, col, bt.shape[1]
            s.bt[i] = bt.data_ptr()
            self._bts.append((s, i, bt))
        return s

    def to_chunks(self) -> None:
        """Every B.T chunk-major (what a library with `lora_chunk_major` reads), once."""
        if self.chunked:
            return
        for s, i, bt in self._bts:
            h = chunk_major(bt)
            self.keep.append(h)
            s.bt[i] = h.data_ptr()
        self.chunked = True


def chunk_major(bt: torch.Tensor) -> torch.Tensor:
    """B.T [rank, n] as [ceil(n / CHUNK), rank, CHUNK], columns past n zero."""
    rank, n = bt.shape
    padded = torch.nn.functional.pad(bt, (0, -n % CHUNK))
    return padded.reshape(rank, -1, CHUNK).permute(1, 0, 2).contiguous()


def wants_chunks(lib: ctypes.CDLL) -> bool:
    """Whether the library reads B.T chunk-major (it exports `lora_chunk_major`)."""
    known = getattr(lib, "_localllm_lora_chunks", None)
    if known is None:
        known = lib._localllm_lora_chunks = hasattr(lib, "lora_chunk_major")
    return known


def set_table(lib: ctypes.CDLL, table: LoraTable | None) -> None:
    """The table the calling thread's next `decode_step` applies (None: no adapters)."""
    if lib.set_lora.argtypes is None:
        lib.set_lora.argtypes = [_P]
        lib.set_lora.restype = None
    if table is not None and not table.chunked and wants_chunks(lib):
        table.to_chunks()
    lib.set_lora(None if table is None else ctypes.addressof(table.table))
