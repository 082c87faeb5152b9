"""Q4_K blocks from float rows: ggml-quants.c's `quantize_row_q4_K_ref`, in numpy.

gguf-py has no K-quant quantizer, and Q4_K is the 4-bit type our kernels run best (native CPU
kernels, int4 on CPU, triton). This is the C reference step for step, vectorized over blocks
with every sum taken in the C loop's order in float32 (numpy's pairwise sums round otherwise and
would pick other scales now and then), so the blocks equal the reference's, bit for bit, when it
is compiled without FMA contraction (tests compare against blocks recorded from it:
tests/tools/record_q4_k_blocks.py).

Per super-block of 256: each of its 8 sub-blocks of 32 gets a scale and a min by
`make_qkx2_quants` (21 candidate scales, weighted least squares, weights |x| + rms); the 8
scales and 8 mins are quantized to 6 bits against the super-block's `d` and `dmin` (fp16); the
values are then rounded to 4 bits with those quantized scales.
"""

import numpy as np

QK_K = 256
F32 = np.float32


def _nearest_int(x: np.ndarray) -> np.ndarray:
    # C's `nearest_int`: float32 + 1.5 * 2^23 rounds half to even, as np.rint does
    return np.rint(x).astype(np.int32)


def _make_qkx2(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`make_qkx2_quants(32, 15, x, w, ..., -1, 0.1, 20, false)` for sub-blocks given
    value-major (`x[i]`: value i of every sub-block, contiguous): (scale, -min, levels [32, n])."""
    n = x.shape[0]
    lo = x[0].copy()
    hi = x[0].copy()
    sum_w = w[0].copy()
    sum_x = sum_w * x[0]
    for i in range(1, n):
        lo = np.minimum(lo, x[i])
        hi = np.maximum(hi, x[i])
        sum_w = sum_w + w[i]
        sum_x = sum_x + w[i] * x[i]
    lo = np.minimum(lo, F32(0))
    flat = hi == lo
    span = np.where(flat, F32(1), hi - lo)
    iscale = F32(15) / span
    scale = F32(1) / iscale
    mn = lo.copy()
    levels = np.clip(_nearest_int(iscale * (x - lo)), 0, 15).astype(F32)
    best = np.zeros_like(lo)
    for i in range(n):
        diff = scale * levels[i] + mn - x[i]
        best = best + w[i] * (diff * diff)
    for step in range(21):
        # (the C loop measures from the best min so far: `min` is updated as it goes)
        cur = np.where(flat, F32(1), hi - mn)
        iscale = (F32(-1.0) + F32(0.1) * F32(step) + F32(15)) / cur
        aux = np.clip(_nearest_int(iscale * (x - mn)), 0, 15).astype(F32)
        sum_l = np.zeros_like(lo)
        sum_l2 = np.zeros_like(lo)
        sum_xl = np.zeros_like(lo)
        for i in range(n):
            wl = w[i] * aux[i]
            sum_l += wl
            sum_l2 += wl * aux[i]
            sum_xl += wl * x[i]
        d = sum_w * sum_l2 - sum_l * sum_l
        ok = d > 0
        safe = np.where(ok, d, F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = this_min > 0
        this_min = np.where(pos, F32(0), this_min)
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 > 0, sum_l2, F32(1)), this_scale)
        err = np.zeros_like(lo)
        for i in range(n):
            diff = this_scale * aux[i] + this_min - x[i]
            err += w[i] * (diff * diff)
        better = ok & (err < best)
        levels = np.where(better, aux, levels)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, F32(0), scale)
    mn = np.where(flat, lo, mn)
    levels = np.where(flat, F32(0), levels)
    return scale.astype(F32), (-mn).astype(F32), levels.astype(np.uint8)


CHUNK_SUPERBLOCKS = 1024  # 256K values at a time: the per-value temporaries stay in cache


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks (uint8 [rows, cols / 256 * 144]) of float32 `rows` (cols a multiple of 256)."""
    x = np.ascontiguousarray(rows, dtype=F32)
    n_rows, cols = x.shape
    sb = x.reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks
    out = np.empty((sb.shape[0], 144), np.uint8)
    for i in range(0, sb.shape[0], CHUNK_SUPERBLOCKS):
        out[i : i + CHUNK_SUPERBLOCKS] = _superblocks(sb[i : i + CHUNK_SUPERBLOCKS])
    return out.reshape(n_rows, cols // QK_K * 144)


def _superblocks(sb: np.ndarray) -> np.ndarray:
    nb = sb.shape[0]
    sub = np.ascontiguousarray(sb.reshape(-1, 32).T)  # value-major: sub[i] = value i of each
    sum_x2 = np.zeros(sub.shape[1], F32)
    for i in range(32):
        sum_x2 += sub[i] * sub[i]
    av_x = np.sqrt(sum_x2 / F32(32))
    weights = av_x + np.abs(sub)
    scales, mins, first = _make_qkx2(sub, weights)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    first = first.T.reshape(nb, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / np.where(max_scale > 0, max_scale, 1), F32(0))
    inv_min = np.where(max_min > 0, F32(63) / np.where(max_min > 0, max_min, 1), F32(0))
    # (C stores the int in a uint8 first: a negative never occurs, scales and mins are >= 0)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales), 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins), 63).astype(np.uint8)
    packed = np.zeros((nb, 12), np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    d16 = (max_scale / F32(63)).astype(np.float16)
    dmin16 = (max_min / F32(63)).astype(np.float16)
    d = d16.astype(F32)[:, None] * ls.astype(F32)
    dm = dmin16.astype(F32)[:, None] * lm.astype(F32)
    safe = np.where(d == 0, F32(1), d)
    q = np.clip(_nearest_int((sb + dm[:, :, None]) / safe[:, :, None]), 0, 15).astype(np.uint8)
    # a sub-block whose quantized scale is 0 keeps make_qkx2's levels, as the C loop skips it
    q = np.where((d == 0)[:, :, None], first, q).reshape(nb, 4, 2, 32)  # pairs of sub-blocks
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(nb, 128)
    return np.concatenate([d16.view(np.uint8).reshape(nb, 2), dmin16.view(np.uint8).reshape(nb, 2),
                           packed, qs], axis=1)  # fmt: skip
