"""The converted-family fixtures (tests/data/families): tiny random-weight transformers models of
smollm3, olmo2, gemma2 and glm4moe converted by llama.cpp's `convert_hf_to_gguf.py`, with
transformers' fp32 outputs (made by tests/tools/record_family_fixtures.py).

`golden(name)` reads one's JSON; `golden_logits` decodes its teacher-forced logits; the near-tie
rule for greedy tokens against those logits is `assert_greedy_matches`.
"""

import base64
import functools
import json
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parents[1] / "data" / "families"
NAMES = ["smollm3", "olmo2", "gemma2", "glm4moe", "glm4moe_air"]


def path(name: str) -> Path:
    return DATA / f"{name}.gguf"


@functools.cache
def golden(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def sequence(name: str) -> list[int]:
    """The prompt's ids then transformers' greedy tokens: what the logits were recorded on."""
    g = golden(name)
    return g["prompt"]["ids"] + g["greedy_ids"]


def golden_logits(name: str) -> torch.Tensor:
    """transformers' fp32 logits [len(sequence), vocab]: row t predicts token t + 1."""
    lg = golden(name)["logits"]
    raw = np.frombuffer(base64.b64decode(lg["base64"]), dtype=np.float32)
    return torch.from_numpy(raw.reshape(lg["shape"]).copy())


def assert_greedy_matches(name: str, got: list[int], tie: float) -> None:
    """Our greedy tokens equal transformers', or part from them only at a near-tie: at the first
    difference, transformers' logits score both choices within `tie` (same context up to there,
    so its recorded row applies)."""
    want = golden(name)["greedy_ids"]
    assert len(got) == len(want), (name, got, want)
    i = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if i is None:
        return
    row = golden_logits(name)[len(golden(name)["prompt"]["ids"]) - 1 + i]
    gap = abs((row[want[i]] - row[got[i]]).item())
    assert gap < tie, f"{name}: step {i} took {got[i]} over {want[i]}, {gap:.3g} apart: no tie"
