"""`moe_gemv.c`'s `split_run`: a decode step's CPU shares of every split layer in one native call.

Per layer it waits for the layer's GPU flag, computes the layer's pairs as `RowsCall` does
(`moe_pairs` + `moe_combine`, each pair its own group in routing order: the same bits), and sets
the layer's CPU flag; no Python runs between layers, where a Python loop cost ~20-40 us a layer
on the critical path. The layers are laid out once per captured graph as `SplitLayer`s, the C
struct's ctypes twin, over buffers that stay put (page-locked rows and sums, one scratch).
"""

import ctypes
from dataclasses import dataclass

import torch

from localllm.kernels.cpu.native import NativeKernels, quant_buffers
from localllm.kernels.cpu.rows_call import RowsCall

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_INTS = ("t", "k", "n_expert", "dim", "hidden", "tg", "tu", "td", "act")
_PTRS = ("x", "w", "ids", "y", "gstart", "tok", "pos", "xq", "kq", "aq", "xd", "kd", "ad", "h",
         "dn", "xb", "kb", "ab")  # fmt: skip
MAX_PAIRS = 256  # SPLIT_MAX_PAIRS in the C


class SplitLayer(ctypes.Structure):
    """`split_layer` in moe_gemv.c, field for field (int64, pointers and doubles: no padding)."""

    _fields_ = [
        ("gpu_flag", _P),
        ("cpu_flag", _P),
        *((n, _I) for n in _INTS),
        *((n, _P) for n in ("gate", "up", "down")),
        *((n, _I) for n in ("sg", "su", "sd")),
        *((n, _P) for n in _PTRS),
        ("wait_s", _D),
        ("cpu_s", _D),
    ]


@dataclass(frozen=True)
class SplitSpec:
    """One layer: its prepared call, token rows `t`, and addresses: its GPU and CPU flags (int32)
    and its page-locked rows x [t, dim], weights [t, k], ids [t, k] (int64) and sum y [t, dim]."""

    call: RowsCall
    t: int
    gpu_flag: int
    cpu_flag: int
    x: int
    w: int
    ids: int
    y: int


class SplitRun:
    """The layers of one captured step; `__call__` runs a replay's CPU side."""

    def __init__(self, native: NativeKernels, specs: list[SplitSpec]) -> None:
        self.lib, self.n = native.lib, len(specs)
        pairs = [s.t * s.call.k for s in specs]
        if max(pairs, default=0) > MAX_PAIRS:
            raise ValueError(f"{max(pairs)} pairs in a split layer: at most {MAX_PAIRS}")
        rows = max((s.t * s.call.dim for s in specs), default=0)
        act = max((p * s.call.hidden for p, s in zip(pairs, specs, strict=True)), default=0)
        out = max((p * s.call.dim for p, s in zip(pairs, specs, strict=True)), default=0)
        # one scratch for all: the layers run one after another (kept: the structs point in)
        x8, k8, a8 = quant_buffers(rows), quant_buffers(rows), quant_buffers(act)
        h, dn = torch.empty(2 * act), torch.empty(out)
        self._keep = (x8, k8, a8, h, dn)
        self.layers = (SplitLayer * self.n)()
        for lay, s in zip(self.layers, specs, strict=True):
            c = s.call
            k8s = k8 if c.two else x8
            ints = (s.t, c.k, c.blocks[0].shape[0], c.dim, c.hidden, *c.types, c.act)
            bufs = (c.gstart, c.tok, c.pos, x8[0], k8s[0], a8[0], x8[1], k8s[1], a8[1], h, dn,
                    x8[2], k8s[2], a8[2])  # fmt: skip
            ptrs = (s.x, s.w, s.ids, s.y, *(b.data_ptr() for b in bufs))
            lay.gpu_flag, lay.cpu_flag = s.gpu_flag, s.cpu_flag
            for name, v in zip(_INTS, ints, strict=True):
                setattr(lay, name, v)
            lay.gate, lay.up, lay.down = c.base
            lay.sg, lay.su, lay.sd = c.stride
            for name, v in zip(_PTRS, ptrs, strict=True):
                setattr(lay, name, v)

    def __call__(self, seq: int, timeout_us: int, threads: int) -> int:
        """-1 when every layer ran; else the failing layer's index (its rows never came) or
        -2 - index (an expert id out of range); every CPU flag holds `seq` either way."""
        return self.lib.split_run(ctypes.addressof(self.layers), self.n, seq, timeout_us, threads)

    def timings(self) -> list[tuple[float, float]]:
        """(seconds waited for the GPU's rows, seconds computing) per layer since the last call."""
        out = []
        for lay in self.layers:
            out.append((lay.wait_s, lay.cpu_s))
            lay.wait_s = lay.cpu_s = 0.0
        return out
