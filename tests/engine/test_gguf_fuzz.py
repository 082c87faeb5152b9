"""Corrupted GGUF files: truncation at every header byte, seeded bit flips and garbage words.

Whatever the damage, open_gguf must either succeed (and then every weight must load) or raise a
GGUFError naming the file: never another exception, never a hang (each open runs under a timer),
never a giant allocation (the whole file set is a few KiB, so anything big would be a bug).
"""

import contextlib
import signal
import struct

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from localllm.engine.gguf import GGUFError, open_gguf
from localllm.kernels.quant import QuantType
from tests.engine.gguf_fixtures import GGUFValue, random_blocks, write_gguf

TRIAL_SECONDS = 2.0
HINTS = ("truncated", "claims", "runs past the end", "empty file")


class _Hang(Exception):
    pass


@contextlib.contextmanager
def time_budget(seconds: float):
    def on_alarm(signum, frame):
        raise _Hang(f"open_gguf took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """A small file using every value kind, and where its tensor data starts and ends."""
    path = tmp_path_factory.mktemp("fuzz") / "sample.gguf"
    meta = {
        "general.name": "fuzz ü",
        "llama.block_count": GGUFValue(2, VT.UINT32),
        "llama.rope.freq_base": 10000.0,
        "x.u64": GGUFValue(2**40, VT.UINT64),
        "x.f64": GGUFValue(0.25, VT.FLOAT64),
        "x.flag": True,
        "tokenizer.ggml.tokens": ["<s>", "</s>", "▁a", "b", "🦙"],
        "tokenizer.ggml.scores": np.arange(5, dtype=np.float32),
        "tokenizer.ggml.token_type": np.array([3, 3, 1, 1, 1], np.int32),
        "x.nested": [[1, 2], [3]],
    }
    tensors = {
        "token_embd.weight": np.ones((5, 8), np.float32),
        "blk.0.attn_q.weight": random_blocks(QuantType.Q4_0, (2, 32), 1),
        "blk.0.ffn_up.weight": random_blocks(QuantType.Q6_K, (1, 256), 2),
        "output_norm.weight": np.ones(8, np.float16),
    }
    write_gguf(path, meta, tensors, alignment=64)
    model = open_gguf(path)
    data_start = min(t.range.offset for t in model.tensors.values())
    data_end = max(t.range.offset + t.range.nbytes for t in model.tensors.values())
    return path.read_bytes(), data_start, data_end


def open_damaged(tmp_path, content: bytes, name="damaged.gguf"):
    """Open `content`; return the model or the GGUFError. Anything else fails the test."""
    path = tmp_path / name
    path.write_bytes(content)
    try:
        with time_budget(TRIAL_SECONDS):
            model = open_gguf(path)
            for tensor in model.tensors:
                model.weight(tensor)
            return model
    except GGUFError as e:
        assert str(e).startswith(f"{path}: "), str(e)
        return e


def test_truncated_at_every_header_byte(tmp_path, sample):
    content, data_start, _ = sample
    for cut in range(data_start):
        got = open_damaged(tmp_path, content[:cut])
        assert isinstance(got, GGUFError), f"a file cut at {cut} opened"
        assert any(h in str(got) for h in HINTS), str(got)


def test_truncated_in_the_data(tmp_path, sample):
    content, data_start, data_end = sample
    cuts = np.random.default_rng(0).integers(data_start, len(content), 64)
    for cut in [data_start, data_end - 1, data_end, len(content) - 1, *cuts.tolist()]:
        got = open_damaged(tmp_path, content[:cut])
        if cut < data_end:
            assert isinstance(got, GGUFError) and "runs past the end" in str(got), cut
        else:  # only padding after the last tensor was lost
            assert not isinstance(got, GGUFError), got


def test_random_bit_flips(tmp_path, sample):
    content, data_start, _ = sample
    rng = np.random.default_rng(1234)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(600):
        damaged = bytearray(content)
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(0, data_start))
            damaged[pos] ^= 1 << int(rng.integers(0, 8))
        got = open_damaged(tmp_path, bytes(damaged))
        outcomes["error" if isinstance(got, GGUFError) else "ok"] += 1
    # Both outcomes occur: flips in string bytes or padding are harmless, others are caught.
    assert outcomes["ok"] > 20 and outcomes["error"] > 200, outcomes


def test_random_garbage_words(tmp_path, sample):
    # Overwrite aligned-ish 4/8-byte words (counts, lengths, types, offsets) with extreme values.
    content, data_start, _ = sample
    rng = np.random.default_rng(99)
    extremes = [0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
    for _ in range(300):
        damaged = bytearray(content)
        pos = int(rng.integers(0, data_start - 8))
        value = extremes[int(rng.integers(len(extremes)))]
        if rng.random() < 0.5:
            value = int(rng.integers(0, 2**63))
        struct.pack_into("<Q", damaged, pos, value)
        open_damaged(tmp_path, bytes(damaged))
