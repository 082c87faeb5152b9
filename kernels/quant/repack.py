"""Column-major ("packed") layouts of Q4_K, Q6_K, Q8_0 (and experts' Q5_0) blocks for the GPU
dp4a kernels.

The bytes stay the GGUF file's (same codes, same scales, same count); only their order changes.
A GEMV program owns a run of output rows and walks K: with the file's row-major blocks its warps
read one row each and must reduce across lanes; with each 4-byte word of every block moved to
plane [word index along K, row], neighbouring threads read neighbouring rows (coalesced) and each
thread's sums stay in its registers. Words keep their bytes, so 4 consecutive codes still sit in
one int32 for a dp4a. Pure torch: packing runs once at upload, on any device.
"""

from dataclasses import dataclass

import torch

from localllm.kernels.quant import widen
from localllm.kernels.quant.types import QuantType, block_geometry

# Per type: the block's byte fields in order, each (name, start, end, dtype of its words).
_FIELDS: dict[QuantType, tuple[tuple[str, int, int, torch.dtype], ...]] = {
    # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    QuantType.Q4_K: (("hdr", 0, 16, torch.int32), ("qs", 16, 144, torch.int32)),
    # 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d
    QuantType.Q6_K: (
        ("ql", 0, 128, torch.int32),
        ("qh", 128, 192, torch.int32),
        ("sc", 192, 208, torch.int32),
        ("d", 208, 210, torch.float16),
    ),
    # fp16 d, 32 int8 codes
    QuantType.Q8_0: (("d", 0, 2, torch.float16), ("qs", 2, 34, torch.int32)),
    # fp16 d, the 32 fifth bits, 16 bytes of nibbles (low: elements 0-15, high: 16-31); experts
    # alone (`widen.NATIVE_Q5_0`): words of 4 bytes at byte 2 and 6 of a 22-byte block
    QuantType.Q5_0: (
        ("d", 0, 2, torch.float16),
        ("qh", 2, 6, torch.int32),
        ("qs", 6, 22, torch.int32),
    ),
}
# Types every packed kernel takes (dense linears and experts alike)
PACKED_TYPES = frozenset({QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0})


def packs(qtype: QuantType, k: int) -> bool:
    """Whether packed experts take rows of `k` values of `qtype` (a whole number of blocks)."""
    native = qtype in PACKED_TYPES or (qtype == QuantType.Q5_0 and widen.NATIVE_Q5_0)
    return native and k % block_geometry(qtype)[0] == 0


@dataclass(frozen=True, slots=True)
class PackedBlocks:
    """A weight [N, K] whose block fields are planes [blocks * words per block, N].

    `planes` maps a field name (see `_FIELDS`) to its plane; plane row b * w + i holds word i of
    block b of every weight row.
    """

    qtype: QuantType
    n: int
    k: int
    planes: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.planes.values())).device


def pack_blocks(data: torch.Tensor, qtype: QuantType, n: int, k: int) -> PackedBlocks:
    """Raw blocks uint8 [N, row_bytes] -> PackedBlocks (one transposed copy per field)."""
    qtype = QuantType(qtype)
    if qtype not in _FIELDS:
        raise ValueError(f"no packed layout for {qtype.name}")
    block, nbytes = block_geometry(qtype)
    if k % block or data.numel() != n * (k // block) * nbytes:
        raise ValueError(f"{qtype.name} data of {data.numel()} bytes is not a {n}x{k} weight")
    nb = k // block
    blocks = data.reshape(n, nb, nbytes)
    planes = {}
    for name, start, end, dtype in _FIELDS[qtype]:
        words = blocks[:, :, start:end].contiguous().view(dtype)  # [N, nb, w]
        planes[name] = words.permute(1, 2, 0).reshape(-1, n).contiguous()
    return PackedBlocks(qtype, n, k, planes)


def unpack_blocks(p: PackedBlocks) -> torch.Tensor:
    """The inverse of `pack_blocks`: raw blocks uint8 [N, row_bytes]."""
    block, nbytes = block_geometry(p.qtype)
    nb = p.k // block
    parts = []
    for name, start, end, dtype in _FIELDS[p.qtype]:
        w = (end - start) // torch.tensor([], dtype=dtype).element_size()
        plane = p.planes[name].reshape(nb, w, p.n).permute(2, 0, 1).contiguous()
        parts.append(plane.view(torch.uint8))  # [N, nb, end - start]
    return torch.cat(parts, dim=2).reshape(p.n, nb * nbytes)


def pack_expert_blocks(data: torch.Tensor, qtype: QuantType, n: int, k: int) -> PackedBlocks:
    """Stacked expert weights, raw uint8 [E, N, row_bytes] -> PackedBlocks whose planes are
    [E, words, N]: each expert's planes are those `pack_blocks` gives its slice, contiguous.
    Q4_0 / Q5_0 / IQ4_NL experts are packed as the Q8_0 blocks they widen to, exactly (`widen`;
    Q5_0 as it is with `widen.NATIVE_Q5_0`)."""
    qtype = QuantType(qtype)
    if widen.widened_type(qtype) != qtype:
        wide = widen.widen_blocks(data.reshape(data.shape[0], n, -1), qtype)
        data, qtype = wide, widen.widened_type(qtype)
    if qtype not in _FIELDS:
        raise ValueError(f"no packed layout for {qtype.name}")
    block, nbytes = block_geometry(qtype)
    e, nb = data.shape[0], k // block
    if k % block or data.numel() != e * n * nb * nbytes:
        raise ValueError(f"{qtype.name} data of {data.numel()} bytes is not {e} x {n}x{k}")
    blocks = data.reshape(e, n, nb, nbytes)
    planes = {}
    for name, start, end, dtype in _FIELDS[qtype]:
        words = blocks[..., start:end].contiguous().view(dtype)  # [E, N, nb, w]
        planes[name] = words.permute(0, 2, 3, 1).reshape(e, -1, n).contiguous()
    return PackedBlocks(qtype, n, k, planes)


def pack_into(dst: PackedBlocks, expert: int, data: torch.Tensor, row0: int = 0) -> None:
    """Pack raw blocks uint8 [n, row_bytes] straight into rows row0..row0+n of expert `expert`
    of a `pack_expert_blocks`-shaped dst: one strided copy per field (two where the block size
    does not keep the field's words aligned), no intermediate planes."""
    block, nbytes = block_geometry(dst.qtype)
    n, nb = data.shape[0], dst.k // block
    if data.numel() != n * nb * nbytes or row0 + n > dst.n:
        raise ValueError(f"{dst.qtype.name} data of {data.numel()} bytes is not {n}x{dst.k}")
    blocks = data.reshape(n, nb, nbytes)
    for name, start, end, dtype in _FIELDS[dst.qtype]:
        field = blocks[..., start:end]
        size = torch.tensor([], dtype=dtype).element_size()
        if nbytes % size or start % size:  # unaligned words: make the field contiguous first
            field = field.contiguous()
        words = field.view(dtype)  # [n, nb, w]
        plane = dst.planes[name][expert].view(nb, -1, dst.n)[:, :, row0 : row0 + n]
        plane.copy_(words.permute(1, 2, 0))


def expert_planes(p: PackedBlocks, expert: int) -> PackedBlocks:
    """One expert of a `pack_expert_blocks` result as an ordinary PackedBlocks (views)."""
    return PackedBlocks(p.qtype, p.n, p.k, {name: t[expert] for name, t in p.planes.items()})
