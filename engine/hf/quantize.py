"""Float weights to ggml blocks at load (`--quantize`), through gguf-py's quantizers.

`gguf.quants.quantize` is ggml-quants.c's reference, bit for bit, in numpy. We tried a torch
port first: on the 2-core dev box it was 3-8x slower (Q8_0 over 16M weights: 1.1 s against
gguf-py's 0.14 s), so the library it is, fed row chunks so the float32 scratch stays at
`CHUNK_VALUES` whatever the tensor. The types offered are those our kernels run fast: Q8_0
(native CPU kernels, triton), Q4_K (native CPU kernels, int4, triton; made by `quantize_k`, a
numpy port of ggml's reference, since gguf-py has no K-quant quantizer: ~5 M weights/s on the
2-core dev box against Q8_0's ~100 M), Q4_0 (int4 on CPU, triton) and the Q4_1/Q5_0/Q5_1
siblings.
"""

import ctypes
import ctypes.util

import numpy as np
import torch

from localllm.kernels.quant import QuantType, block_geometry

CHUNK_VALUES = 1 << 22  # float32 scratch per chunk: 16 MiB

# `--quantize` names -> type (the first is the documented default suggestion)
QUANTIZE_TYPES = {
    "q8_0": QuantType.Q8_0,
    "q4_k": QuantType.Q4_K,  # ours (`quantize_k`): gguf-py has no K-quant quantizer
    "q4_0": QuantType.Q4_0,
    "q4_1": QuantType.Q4_1,
    "q5_0": QuantType.Q5_0,
    "q5_1": QuantType.Q5_1,
}


# The type for a row that is not a whole number of 256-value K-quant blocks (SmolLM2's 576).
# llama-quantize takes Q5_0; ours is Q8_0, which our CPU kernels run on its blocks (Q5_0 would
# become an fp16 copy there, twice the bytes) and triton runs on a GPU.
FALLBACK = {QuantType.Q4_K: QuantType.Q8_0}


def can_quantize(qtype: QuantType, row: int) -> bool:
    return qtype in QUANTIZE_TYPES.values() and row % block_geometry(qtype)[0] == 0


def store_type(qtype: QuantType, row: int) -> QuantType | None:
    """The type a row of `row` values is made in for `--quantize qtype` (a K-quant falls back to
    llama-quantize's choice where the row is not whole blocks), or None: it stays as stored."""
    for t in (qtype, FALLBACK.get(qtype)):
        if t is not None and can_quantize(t, row):
            return t
    return None


def quantize(x: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """ggml blocks (uint8 [*x.shape[:-1], row bytes]) of `x` (any float dtype)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from localllm.engine.hf.quantize_k import quantize_q4_k

    block, nbytes = block_geometry(qtype)
    gtype = GGMLQuantizationType(int(qtype))
    fn = quantize_q4_k if qtype == QuantType.Q4_K else (lambda a: gguf_quantize(a, gtype))
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty((rows.shape[0], rows.shape[1] // block * nbytes), dtype=np.uint8)
    step = max(1, CHUNK_VALUES // max(rows.shape[1], 1))
    for i in range(0, rows.shape[0], step):
        chunk = rows[i : i + step].to(torch.float32).numpy()
        out[i : i + step] = fn(chunk)
    return torch.from_numpy(out).reshape(*x.shape[:-1], -1)


def release_scratch() -> None:
    """Hand the freed quantization scratch back to the OS (glibc keeps freed heap otherwise:
    ~100 MiB after quantizing a 135M model, measured). A no-op where there is no malloc_trim."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)
