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
