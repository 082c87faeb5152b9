"""A copy of a GGUF with extra uint32 metadata keys (tests give SmolLM2 FIM token ids this way).

The new keys go after the existing ones, padded to the file's alignment with one more string
key, so the tensor infos and data move by a whole number of alignment units and stay valid.
"""

import shutil
import struct
from pathlib import Path

import gguf

UINT32, STRING = 4, 8


def _key(name: str) -> bytes:
    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw


def with_metadata(src: Path, dst: Path, extra: dict[str, int]) -> Path:
    reader = gguf.GGUFReader(str(src))
    end_of_kv = max(f.offset + sum(p.nbytes for p in f.parts) for f in reader.fields.values())
    align = reader.alignment
    blob = b"".join(_key(k) + struct.pack("<II", UINT32, v) for k, v in extra.items())
    pad_key = _key("localllm.test.pad") + struct.pack("<I", STRING)
    fixed = len(blob) + len(pad_key) + 8  # + the pad string's length field
    pad = b" " * (-fixed % align)
    blob += pad_key + struct.pack("<Q", len(pad)) + pad
    with open(src, "rb") as f:
        head = f.read(end_of_kv)
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", head)
        with open(dst, "wb") as out:
            out.write(struct.pack("<4sIQQ", magic, version, n_tensors, n_kv + len(extra) + 1))
            out.write(head[24:])
            out.write(blob)
            shutil.copyfileobj(f, out, 1 << 20)
    return dst
