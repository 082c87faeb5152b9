"""`float_gemv.c`: a float32 or bfloat16 weight matrix times a few float32 rows on the CPU,
compiled at first use with the system C compiler (cached on disk like `native.py`'s kernels)
and loaded with ctypes; the calls release the GIL.

`load()` answers a `FloatGemv`, or None where no compiler or a failed self-check (the kernel
against `linear_reference` on random matrices) leaves callers on torch. `linear_reference` is
the torch math the kernel computes (float32 sums of float32 products; bfloat16 weights widened
exactly), and the fallback.
"""

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from localllm.kernels.cpu.cbuild import built_libraries

SOURCE = Path(__file__).with_name("float_gemv.c")
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-fopenmp"), ("-O3",))
CHECK_TOL = 1e-4  # relative: float32 sums in another order; a wrong kernel is ~1

_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def linear_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """x (m, k) float32 times w (n, k) float32 or bfloat16, plus bias: (m, n) float32."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float())


@dataclass(frozen=True)
class FloatGemv:
    lib: ctypes.CDLL
    path: Path
    flags: tuple[str, ...]
    max_rows: int
    lanes: int

    def supports(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether `linear(x, w)` runs here: CPU, x float32 (m <= max_rows, k) and w (n, k)
        float32 or bfloat16, both contiguous, k a multiple of the kernel's lanes."""
        return (
            x.device.type == "cpu"
            and w.device.type == "cpu"
            and x.dtype == torch.float32
            and w.dtype in (torch.float32, torch.bfloat16)
            and x.dim() == 2
            and 0 < x.shape[0] <= self.max_rows
            and x.shape[1] == w.shape[1]
            and w.shape[1] % self.lanes == 0
            and x.is_contiguous()
            and w.is_contiguous()
        )

    def linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """(m, n) float32 = x (m, k) . w (n, k)^T + bias; the caller checked `supports`."""
        m, (n, k) = x.shape[0], w.shape
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        if bias is not None:
            bias = bias.float().contiguous()
        self.lib.float_gemv(
            int(w.dtype == torch.bfloat16), w.data_ptr(), n, k, x.data_ptr(), m,
            None if bias is None else bias.data_ptr(), out.data_ptr(),
            threads or torch.get_num_threads(),
        )  # fmt: skip
        return out


def _bind(lib: ctypes.CDLL) -> None:
    lib.float_gemv.argtypes = [_INT, _P, _I, _I, _P, _I, _P, _P, _INT]
    lib.float_gemv.restype = None
    lib.float_gemv_max_rows.restype = _INT
    lib.float_gemv_lanes.restype = _INT


def self_check(g: FloatGemv, seed: int = 0) -> bool:
    """Each row count, both weight types, with and without a bias, a short last block."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 37, 4 * g.lanes
    for m in range(1, g.max_rows + 1):
        x = torch.randn(m, k, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(n, k, generator=gen).to(dtype)
            for bias in (None, torch.randn(n, generator=gen)):
                want = linear_reference(x, w, bias)
                got = g.linear(x, w, bias)
                if not ((got - want).norm() <= CHECK_TOL * want.norm()):
                    return False
    return True


@functools.cache
def load(cache_dir: Path | None = None) -> FloatGemv | None:
    """The compiled kernel, checked, or None (callers keep torch)."""
    for lib, path, flags in built_libraries((SOURCE,), FLAG_SETS, "localllm-float-gemv", _bind,
                                            cache_dir):  # fmt: skip
        g = FloatGemv(lib, path, flags, lib.float_gemv_max_rows(), lib.float_gemv_lanes())
        if self_check(g):
            return g
    return None
