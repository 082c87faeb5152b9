"""The recorded Idefics3 (SmolVLM-architecture) fixture of tests/data/vision/: paths, reference
values and a small engine helper shared by the vision tests (`tests/tools/record_vision_fixtures.py`
made it: transformers fp32 on a tiny random-weight model, converted by llama.cpp's converter)."""

import base64
import json
from functools import cache
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data" / "vision"
TEXT = DATA / "idefics3-text.gguf"
MMPROJ = DATA / "mmproj-idefics3.gguf"


@cache
def record() -> dict:
    return json.loads((DATA / "idefics3.json").read_text())


def floats(b64: str, shape) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").reshape(shape)


def image_bytes(name: str) -> bytes:
    return (DATA / name).read_bytes()


def run_greedy(engine, ids, mm, n: int, rid: str = "r") -> tuple[list[int], object]:
    """Greedy tokens of one request through `LLMEngine` (and its last output)."""
    from localllm.engine import SamplingParams

    engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=n), mm_inputs=mm)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last is not None and not last.error, last
    return list(last.outputs[0].token_ids), last


def rewrite_mmproj(dst, changes: dict | None = None, drop=(), qtype=None) -> Path:
    """The fixture mmproj written again with metadata `changes` (key -> string), tensors
    `drop`ped, and with `qtype` (a gguf.GGMLQuantizationType) its F16 matrices requantized."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    changes = changes or {}
    r = GGUFReader(str(MMPROJ))
    w = GGUFWriter(str(dst), "clip")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in changes:
            w.add_string(key, changes[key])
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), kind, sub_type=sub)
    for t in r.tensors:
        if t.name in drop:
            continue
        data, kind = np.array(t.data), t.tensor_type
        if qtype is not None and kind == GGMLQuantizationType.F16:
            data, kind = quants.quantize(data.astype(np.float32), qtype), qtype
        w.add_tensor(t.name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
