"""torch's CPU int4 weight format (`_convert_weight_to_int4pack_for_cpu`), and its inverse.

The packed layout depends on the CPU build (AVX2 packs rows d and d+16 of each 32-row block
into one byte, AVX-512 interleaves 64-row blocks, tails pack row pairs). torch has no unpack, so
`unpack_t` tries the known layouts once per process on a probe matrix and uses the one that inverts
the op exactly; if none does, `unpack_supported()` is False and callers avoid unpacking.
Row slices of a packed matrix at multiples of 64 rows are packed matrices themselves.
"""

import functools

import torch

# Row count of the probe: one or more full blocks plus a 48/16-row tail for both 32 and 64 blocks.
_PROBE_N, _PROBE_K = 176, 64


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8/int [N, K] codes in 0..15 -> torch's packed uint8 [N, K/2] (N % 16 == 0)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)


def _pairs(b: torch.Tensor, k: int, rows: int) -> torch.Tensor:
    # tail layout: byte [k, n/2] holds rows n (low nibble) and n+1 (high nibble)
    b = b.reshape(k, rows // 2)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(k, rows)


def _split(b: torch.Tensor, k: int, block: int) -> torch.Tensor:
    # full-block layouts, all blocks at once: a 32-row block is [k, 16] bytes (rows d | d+16 << 4);
    # a 64-row block is two 16-byte lanes: (d | d+32 << 4) then (d+16 | d+48 << 4).
    b = b.reshape(-1, k, block // 32, 16)
    lo, hi = (b & 0xF), (b >> 4)
    if block == 32:
        rows = torch.cat([lo[:, :, 0], hi[:, :, 0]], dim=2)
    else:
        rows = torch.cat([lo[:, :, 0], lo[:, :, 1], hi[:, :, 0], hi[:, :, 1]], dim=2)
    return rows.permute(1, 0, 2).reshape(k, -1)


def _unpack_with(packed: torch.Tensor, block: int | None) -> torch.Tensor:
    n, half_k = packed.shape
    k = half_k * 2
    flat = packed.reshape(-1)
    full = n // block * block if block is not None else 0
    parts = [_split(flat[: full * half_k], k, block)] if full else []
    for start in range(full, n, 16 if block is None else block):
        rows = min(block or 16, n - start)
        parts.append(_pairs(flat[start * half_k : (start + rows) * half_k], k, rows))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


@functools.cache
def _layout() -> tuple[bool, int | None]:
    gen = torch.Generator().manual_seed(1234)
    probe = torch.randint(0, 16, (_PROBE_N, _PROBE_K), generator=gen, dtype=torch.uint8)
    packed = pack(probe)
    for block in (32, 64, None):
        if torch.equal(_unpack_with(packed, block), probe.T):
            return True, block
    return False, None


def unpack_supported() -> bool:
    """Whether this torch build's packed layout is one `unpack_t` knows (checked on a probe)."""
    return _layout()[0]


def unpack_float_t(packed: torch.Tensor, k0: int = 0, k1: int | None = None) -> torch.Tensor:
    """Like unpack_t for code columns k0:k1, straight into float32 [k1 - k0, n].

    The fp32 path's hot loop: nibbles are converted while being scattered into place (two
    converting copies per layout part), with no uint8 intermediate of the full tile.
    """
    ok, block = _layout()
    if not ok:
        raise RuntimeError("unknown int4pack layout in this torch build")
    n, half_k = packed.shape
    k = 2 * half_k
    k1 = k if k1 is None else k1
    out = torch.empty(k1 - k0, n, dtype=torch.float32, device=packed.device)
    full = n // block * block if block is not None else 0
    if full:
        # both full-block layouts: low nibbles of a block's bytes are its first half of rows
        b = packed[:full].reshape(full // block, k, block // 2)[:, k0:k1].transpose(0, 1)
        o = out[:, :full].view(k1 - k0, full // block, block)
        o[..., : block // 2].copy_(b & 0xF)
        o[..., block // 2 :].copy_(b >> 4)
    step = 16 if block is None else block
    for start in range(full, n, step):
        rows = min(step, n - start)
        b = packed[start : start + rows].reshape(k, rows // 2)[k0:k1]
        o = out[:, start : start + rows].view(k1 - k0, rows // 2, 2)
        o[..., 0].copy_(b & 0xF)
        o[..., 1].copy_(b >> 4)
    return out


def unpack_t(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8 [n, K/2] (a whole matrix, or a row slice starting at a multiple of 64)
    -> the codes transposed, uint8 [K, n] (K-major: what x @ W.T wants)."""
    ok, block = _layout()
    if not ok:
        raise RuntimeError("unknown int4pack layout in this torch build")
    return _unpack_with(packed, block)
