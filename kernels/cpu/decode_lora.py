"""LoRA deltas inside the native CPU decode step (`decode_step.c`'s `lora_t`, `set_lora`): each
block linear's adapters as float16 A [r, in] and, per output part, B.T [hi - lo, n] at its column
(float32 math), and the rows' adapter factors W [rows, r]; `LoraTable` holds one step's table (4
per layer: q|k|v, o, gate|up, down) and keeps its tensors alive. The torch reference is
`engine.lora.delta`'s own ops (tests/lora/test_lora_native.py holds the step to them).
"""

import ctypes
from dataclasses import dataclass

import torch

from localllm.kernels.cpu.decode_step import MAX_GROUPS

_I, _P = ctypes.c_int64, ctypes.c_void_p
LINEARS = 4  # per layer, in the C's order: q|k|v, o, gate|up, down


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
        return s


def set_table(lib: ctypes.CDLL, table: LoraTable | None) -> None:
    """The table the calling thread's next `decode_step` applies (None: no adapters)."""
    if lib.set_lora.argtypes is None:
        lib.set_lora.argtypes = [_P]
        lib.set_lora.restype = None
    lib.set_lora(None if table is None else ctypes.addressof(table.table))
