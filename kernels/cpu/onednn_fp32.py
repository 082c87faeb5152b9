"""float32 matmuls on the CPU through oneDNN instead of MKL, where that is still float32 math.

torch's CPU `F.linear` / `matmul` in float32 call MKL's sgemm, which on the AMD box of
2026-12-06 ran 192-214 GFLOP/s at 2 threads (1024 x 768 by 3072 x 768). With
`torch.backends.mkldnn.matmul.fp32_precision = "bf16"` they go through oneDNN: 408-454 GFLOP/s
there, 3.7e-7 from float64 — float32 accuracy, oneDNN kept float32 math on that CPU (no AMX).
The setting only *allows* bfloat16 math, and a CPU with AMX-BF16 may take it (~4e-3 off), so
`fast_fp32()` switches it on only after a probe product here matched float64 to float32
accuracy, and only for the calls inside it (the setting is process-wide: other threads' float32
matmuls in that window take the same path, which the probe showed to be float32 too).
"""

import contextlib
import functools
import threading

import torch

PROBE_TOL = 2e-6  # float32 sums of 768 products: ~3e-7; bfloat16 math: ~4e-3
ENABLED = True  # False: MKL as torch's default


_LOCK = threading.Lock()
_inside = 0  # fast_fp32 blocks open, all threads: the first sets the setting, the last restores it
_kept = "none"


@functools.cache
def fp32_through_onednn() -> bool:
    """Whether oneDNN's path computes a float32 product in float32 on this machine."""
    with _LOCK:
        return _probe()


def _probe() -> bool:
    mkldnn = getattr(torch.backends, "mkldnn", None)
    if mkldnn is None or not mkldnn.is_available() or not hasattr(mkldnn, "matmul"):
        return False
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(64, 768, generator=g), torch.randn(256, 768, generator=g)
    want = a.double() @ w.double().t()
    keep = mkldnn.matmul.fp32_precision
    try:
        mkldnn.matmul.fp32_precision = "bf16"
        got = torch.nn.functional.linear(a, w)
    except (RuntimeError, ValueError):
        return False
    finally:
        mkldnn.matmul.fp32_precision = keep
    return ((got.double() - want).norm() / want.norm()).item() < PROBE_TOL


@contextlib.contextmanager
def fast_fp32():
    """float32 CPU matmuls inside go through oneDNN where `fp32_through_onednn()` (else as
    they were)."""
    global _inside, _kept
    if not ENABLED or not fp32_through_onednn():
        yield
        return
    mm = torch.backends.mkldnn.matmul
    with _LOCK:
        if _inside == 0:
            _kept, mm.fp32_precision = mm.fp32_precision, "bf16"
        _inside += 1
    try:
        yield
    finally:
        with _LOCK:
            _inside -= 1
            if _inside == 0:
                mm.fp32_precision = _kept
