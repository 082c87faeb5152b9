"""Reader for whisper.cpp's ggml `.bin` Whisper files (the `ggml-base.bin` family).

Layout (little endian, no alignment): u32 magic 'ggml', 11 i32 hparams (n_vocab, n_audio_ctx,
n_audio_state, n_audio_head, n_audio_layer, n_text_ctx, n_text_state, n_text_head, n_text_layer,
n_mels, ftype), mel filters (i32 n_mel, i32 n_fft, f32 data), vocab (i32 n, then u32 length +
bytes each), then tensors to the end: i32 n_dims, i32 name length, i32 ggml type, i32 ne[n_dims]
(innermost first), name, data. Quantized tensors are dequantized with our ggml kernels.
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.types import QuantType, block_geometry
from localllm.media.stt.ct2 import view_bytes

GGML_MAGIC = 0x67676D6C
HPARAMS = (
    "n_vocab", "n_audio_ctx", "n_audio_state", "n_audio_head", "n_audio_layer",
    "n_text_ctx", "n_text_state", "n_text_head", "n_text_layer", "n_mels", "ftype",
)  # fmt: skip


class GGMLFormatError(ValueError):
    """Not a whisper.cpp ggml file, or a truncated one."""


@dataclass(frozen=True)
class GGMLWhisper:
    hparams: dict[str, int]
    vocab: list[bytes]  # the text tokens' bytes, by id
    tensors: dict[str, torch.Tensor]  # openai-whisper names, float32 (or float16 as stored)


def is_ggml(path: Path) -> bool:
    if not path.is_file() or path.stat().st_size < 4:
        return False
    with path.open("rb") as f:
        return struct.unpack("<I", f.read(4))[0] == GGML_MAGIC


def _tensor(raw: memoryview, qtype: QuantType, ne: list[int]) -> torch.Tensor:
    shape = tuple(reversed(ne))
    if qtype == QuantType.F32:
        return view_bytes(raw, torch.float32, shape)
    if qtype == QuantType.F16:
        return view_bytes(raw, torch.float16, shape)
    rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    data = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).reshape(rows, -1).copy())
    return dequantize(data, qtype).reshape(shape)


def read_ggml(path: str | Path, with_tensors: bool = True) -> GGMLWhisper:
    """Parse a whisper.cpp ggml file; tensors view a read-only memory map where they can."""
    path = Path(path)
    with path.open("rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf, pos = memoryview(mm), 0

    def take(n: int) -> memoryview:
        nonlocal pos
        if n < 0 or pos + n > len(buf):
            raise GGMLFormatError(f"{path}: truncated at byte {pos}")
        pos += n
        return buf[pos - n : pos]

    def i32s(n: int) -> list[int]:
        return list(struct.unpack(f"<{n}i", take(4 * n)))

    if struct.unpack("<I", take(4))[0] != GGML_MAGIC:
        raise GGMLFormatError(f"{path}: not a whisper.cpp ggml file (bad magic)")
    hp = dict(zip(HPARAMS, i32s(len(HPARAMS)), strict=True))
    n_mel, n_fft = i32s(2)
    take(4 * n_mel * n_fft)  # whisper.cpp's own filterbank; we compute ours (MelSpec)
    (n_vocab,) = i32s(1)
    vocab = [bytes(take(struct.unpack("<I", take(4))[0])) for _ in range(n_vocab)]
    tensors: dict[str, torch.Tensor] = {}
    while with_tensors and pos < len(buf):
        n_dims, name_len, ttype = i32s(3)
        if not 1 <= n_dims <= 4:
            raise GGMLFormatError(f"{path}: bad tensor header at byte {pos}")
        ne = i32s(n_dims)
        name = bytes(take(name_len)).decode("utf-8", errors="replace")
        try:
            qtype = QuantType(ttype)
            block, nbytes = block_geometry(qtype)
        except (ValueError, KeyError):
            raise GGMLFormatError(f"{path}: {name}: unknown ggml type {ttype}") from None
        count = int(np.prod(ne))
        tensors[name] = _tensor(take(count // block * nbytes), qtype, ne)
    return GGMLWhisper(hp, vocab, tensors)


_PARTS = (
    ("blocks.", "layers."),
    ("cross_attn_ln", "cross_ln"),
    ("cross_attn.", "cross."),
    ("attn.query", "attn.q"),
    ("attn.key", "attn.k"),
    ("attn.value", "attn.v"),
    ("cross.query", "cross.q"),
    ("cross.key", "cross.k"),
    ("cross.value", "cross.v"),
    ("mlp.0.", "mlp.fc1."),
    ("mlp.2.", "mlp.fc2."),
)
_FIXED = {
    "encoder.positional_embedding": "encoder.positions",
    "decoder.positional_embedding": "decoder.positions",
    "decoder.token_embedding.weight": "decoder.embed.weight",
}


def ggml_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], int, int]:
    """Our state dict from a ggml file, with the encoder and decoder head counts."""
    g = read_ggml(path)
    sd = {}
    for name, t in g.tensors.items():
        if name in _FIXED:
            name = _FIXED[name]
        else:
            for old, new in _PARTS:
                name = name.replace(old, new)
        if name.endswith(("conv1.bias", "conv2.bias")):
            t = t.reshape(-1)  # stored as [n_state, 1] for ggml's broadcasting
        sd[name] = t
    return sd, g.hparams["n_audio_head"], g.hparams["n_text_head"]
