"""A fixed pool of expert slots on the device, in the packed dp4a layout: streamed experts are
packed into a slot once when read, and decode runs the resident path's grouped GEMVs over the
pool with each (token, choice) pair's expert id replaced by its slot number.

The pool is one `PackedExperts` whose "experts" are the slots (planes [slots, words, N]), so a
pair is computed by the same kernel, with the same split, as the resident layer computes it:
greedy output does not depend on residency. One pool holds one `ExpertFormat` (a Q4_K_M model's
layers with Q6_K `ffn_down_exps` get a pool of their own). Imported only where CUDA exists (or
under TRITON_INTERPRET=1 in tests).
"""

import torch

from localllm.kernels.moe.experts import ExpertFormat
from localllm.kernels.moe.packed import (
    PACKED_MAX_T,
    PackedExperts,
    pack_experts,
)
from localllm.kernels.quant.repack import PackedBlocks, pack_into
from localllm.kernels.quant.types import row_nbytes


def empty_slots(p: PackedBlocks, slots: int) -> PackedBlocks:
    """Zeroed planes for `slots` experts shaped as stacked `p`'s, on its device."""
    planes = {
        name: torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, device=t.device)
        for name, t in p.planes.items()
    }
    return PackedBlocks(p.qtype, p.n, p.k, planes)


def _slot(p: PackedBlocks, slot: int) -> PackedBlocks:
    return PackedBlocks(p.qtype, p.n, p.k, {k: t[slot : slot + 1] for k, t in p.planes.items()})


class PackedSlotPool:
    """`slots` experts of format `fmt` packed on `device`; counters sized for grouped launches of
    up to PACKED_MAX_T tokens x `n_used` choices, as a resident layer's."""

    max_tokens = PACKED_MAX_T  # token rows per call that the grouped GEMVs over slots take

    def __init__(self, fmt: ExpertFormat, slots: int, n_used: int, device: torch.device,
                 maps: list[torch.Tensor] | None = None):  # fmt: skip
        """`maps`: `byte_maps` of another pool of the same format (found once, shared)."""
        self.fmt, self.n_slots = fmt, slots
        d, h = fmt.dim, fmt.hidden
        shapes = (
            (h, row_nbytes(fmt.gate, d)),
            (h, row_nbytes(fmt.up, d)),
            (d, row_nbytes(fmt.down, h)),
        )
        # one zero expert packed gives every plane's shape; the pool repeats it `slots` times
        zero = [torch.zeros((1, r, c), dtype=torch.uint8, device=device) for r, c in shapes]
        one = pack_experts(*zero, fmt, n_used)
        self.pe = PackedExperts(
            tuple(empty_slots(p, slots) for p in one.gate_up),
            empty_slots(one.down, slots),
            one.counters,
        )
        self._bytes = [  # every plane as bytes [slots, plane bytes per slot] (views)
            t.view(torch.uint8).view(slots, -1)
            for p in (*self.pe.gate_up, self.pe.down)
            for t in p.planes.values()
        ]
        # found by packing into slot 0: now, while no slot holds an expert (made on a first
        # fill instead, they clobbered slot 0 under a read-ahead thread filling it)
        self._maps = self._find_maps() if maps is None else maps

    @property
    def nbytes(self) -> int:
        return self.pe.nbytes

    @property
    def slot_nbytes(self) -> int:
        return self.pe.nbytes // self.n_slots

    @property
    def expert_nbytes(self) -> int:
        """Raw bytes of one expert (gate, up, down back to back)."""
        return sum(self._sizes())

    def _sizes(self) -> tuple[int, int, int]:
        f, d, h = self.fmt, self.fmt.dim, self.fmt.hidden
        return h * row_nbytes(f.gate, d), h * row_nbytes(f.up, d), d * row_nbytes(f.down, h)

    @property
    def plane_bytes(self) -> list[torch.Tensor]:
        """Every plane as bytes [slots, plane bytes per slot] (views of the pool)."""
        return self._bytes

    def byte_maps(self) -> list[torch.Tensor]:
        """Per plane, the raw expert byte that each of a slot's plane bytes is (int32 [plane
        bytes]): `fill_raw`'s packing as one gather per plane."""
        return self._maps

    def _find_maps(self) -> list[torch.Tensor]:
        """`byte_maps`, found by packing raw experts whose bytes spell their own offsets, 8 bits
        at a time, into slot 0 (left zeroed)."""
        total = self.expert_nbytes
        pos = torch.arange(total, dtype=torch.int64, device=self.pe.down.device)
        maps = [torch.zeros(t.shape[1], dtype=torch.int64, device=t.device) for t in self._bytes]
        for shift in range(0, max(total - 1, 1).bit_length(), 8):
            self.fill_raw(0, ((pos >> shift) & 255).to(torch.uint8))
            for m, t in zip(maps, self._bytes, strict=True):
                m |= t[0].long() << shift
        for t in self._bytes:
            t[0].zero_()
        return [m.int() for m in maps]

    def fill_mapped(self, slot: int, raw: torch.Tensor) -> PackedExperts:
        """`fill_raw` in one gather per plane (`byte_maps`): a copy to the device that does not
        wait for it (`non_blocking`, from page-locked memory), then 6 launches for a Q4_K_M
        expert instead of ~15. Same bytes in every plane (test)."""
        if raw.numel() < self.expert_nbytes:
            raise ValueError(f"{raw.numel()} bytes do not hold one expert of {self.fmt}")
        flat = raw[: self.expert_nbytes].to(self.pe.down.device, non_blocking=True)
        for dst, index in zip(self._bytes, self.byte_maps(), strict=True):
            torch.index_select(flat, 0, index, out=dst[slot])
        return self.view(slot)

    def fill_raw(self, slot: int, raw: torch.Tensor) -> PackedExperts:
        """Pack one expert's raw bytes back to back (gate, up, down; any device, pinned host
        memory for a fast upload) into `slot`: one copy to the device, then each block field
        written into its plane in place. Returns that slot alone as a one-expert PackedExperts
        (views of the pool, the pool's counters). The reference of `fill_mapped`."""
        dev = self.pe.down.device
        f, d, h = self.fmt, self.fmt.dim, self.fmt.hidden
        sizes = self._sizes()
        if raw.numel() < sum(sizes):
            raise ValueError(f"{raw.numel()} bytes do not hold one expert of {f}")
        flat = raw[: sum(sizes)].to(dev)
        gate, up, down = flat.split(sizes)
        if len(self.pe.gate_up) == 1:  # gate and up share one plane: gate rows first
            pack_into(self.pe.gate_up[0], slot, gate.view(h, -1))
            pack_into(self.pe.gate_up[0], slot, up.view(h, -1), row0=h)
        else:
            pack_into(self.pe.gate_up[0], slot, gate.view(h, -1))
            pack_into(self.pe.gate_up[1], slot, up.view(h, -1))
        pack_into(self.pe.down, slot, down.view(d, -1))
        return self.view(slot)

    def view(self, slot: int) -> PackedExperts:
        pe = self.pe
        return PackedExperts(
            tuple(_slot(p, slot) for p in pe.gate_up), _slot(pe.down, slot), pe.counters
        )
