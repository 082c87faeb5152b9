"""Host memory that CUDA kernels read in place ("mapped" host tier): bytes in an ordinary host
buffer, page-locked and registered with the driver (cudaHostRegister, mapped), seen through CUDA
tensor views of the same addresses. A GPU kernel given such a view reads the host's copy over the
bus, so host-tier weights need no device copy and no host step: the decode graph stays whole.
Needs unified virtual addressing (every 64-bit CUDA platform), where a registered host pointer is
also its device pointer.
"""

import dataclasses
import math
import mmap
import weakref

import torch

_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_ALIGN = 256


class _DeviceView:
    """The `__cuda_array_interface__` of registered host bytes, for `torch.as_tensor`."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        typestr = {torch.int32: "<i4", torch.float16: "<f2", torch.uint8: "|u1",
                   torch.int8: "|i1", torch.float32: "<f4", torch.int16: "<i2",
                   torch.int64: "<i8"}[dtype]  # fmt: skip
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": typestr,
            "strides": None,
            "version": 3,
        }


def _unregister(ptr: int, host: torch.Tensor) -> None:
    # `host` rides along so its bytes are freed only after the driver lets go of them
    torch.cuda.cudart().cudaHostUnregister(ptr)
    del host


def map_tensors(tensors: dict[str, torch.Tensor], device: torch.device | str = "cuda") -> dict:
    """Copies of `tensors` (any device, contiguous) in one registered host buffer, returned as
    CUDA views on `device` (`host_view` gives the same bytes as a CPU tensor, for DMA copies).
    The buffer lives while any returned view does."""
    out = map_empty({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}, device)
    for name, t in tensors.items():
        host_view(out[name]).copy_(t)
    return out


def map_empty(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device="cuda") -> dict:
    """`map_tensors` without the copies: mapped views of (shape, dtype) `specs`, unwritten."""
    spans, total = [], 0
    for shape, dtype in specs.values():
        spans.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    host = _own_pages(max(total, _ALIGN))
    ptr = host.data_ptr()
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, host.numel(), _REGISTER_FLAGS))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {host.numel():,} bytes failed (cudaError {err})")
    out, keep = {}, []
    with torch.cuda.device(device):
        for (name, (shape, dtype)), off in zip(specs.items(), spans, strict=True):
            n = math.prod(shape) * dtype.itemsize
            view = torch.as_tensor(_DeviceView(ptr + off, tuple(shape), dtype), device=device)
            view._host_view = host[off : off + n].view(dtype).view(shape)
            out[name] = view
            keep.append(view)
    # the buffer is unregistered and freed when the last view goes
    anchor = _Anchor()
    for v in keep:
        v._mapped_anchor = anchor  # a tensor attribute: keeps the buffer alive
    weakref.finalize(anchor, _unregister, ptr, host)
    return out


def _own_pages(n: int, page: int = mmap.PAGESIZE) -> torch.Tensor:
    """n host bytes on pages of their own (page-aligned, a whole number of pages): two small
    buffers from the heap can share a page, and the driver refuses a second registration of a
    page already registered (cudaErrorHostMemoryAlreadyRegistered)."""
    size = -(-n // page) * page
    raw = torch.empty(size + page, dtype=torch.uint8)
    off = -raw.data_ptr() % page
    return raw[off : off + size]  # (a view: it keeps `raw` alive)


class _Anchor:
    """Shared by a buffer's views; its finalizer unregisters and frees the buffer."""


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The page-locked CPU tensor behind a mapped CUDA view (a copy from it is a DMA); a CPU
    tensor is its own."""
    return t if t.device.type == "cpu" else t._host_view


def map_packed_experts(pe):
    """A layer's packed experts (`kernels.moe.packed.PackedExperts`) with every plane moved to
    mapped host memory; the split-K counters stay on the device. Same kernels, same bits."""
    from localllm.kernels.quant.repack import PackedBlocks

    def one(p: PackedBlocks) -> PackedBlocks:
        return PackedBlocks(p.qtype, p.n, p.k, map_tensors(p.planes, pe.counters[0].device))

    return dataclasses.replace(pe, gate_up=tuple(one(p) for p in pe.gate_up), down=one(pe.down))


def map_packed_layer(gate, up, down, fmt, n_used: int, device, chunk: int | None = None,
                     empty=map_empty):  # fmt: skip
    """A layer's raw expert blocks (host tensors) as `map_packed_experts` gives them, packed on
    `device` a chunk of experts at a time (`kernels.moe.packed.pack_layer`) and copied into the
    mapped buffer. `empty`: `map_empty` (tests on CPU pass one that makes plain tensors)."""
    from localllm.kernels.moe.packed import PACK_CHUNK, pack_layer

    return pack_layer(gate, up, down, fmt, n_used, device, lambda specs: empty(specs, device),
                      host_view, chunk or PACK_CHUNK)  # fmt: skip
