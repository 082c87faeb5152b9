"""Chunk-major B.T for the native CPU step's LoRA expand (`kernels.cpu.decode_lora.chunk_major`,
used where the library exports `lora_chunk_major`). The layout against its definition, and the
whole step: the library with the chunk-major expand (the shipped one once it exports the
marker, else a copy of kernels/cpu/decode_step.c with that one change, built here) gives the
row-major step's logits bit for bit, on SmolLM2 with two random rank-4 adapters on every linear
and rows on one, both and no adapter (test_lora_native.py's steps)."""

import argparse
import shutil
from pathlib import Path

import pytest
import torch

from localllm.engine.generator import Generator
from localllm.engine.layers.native_decode import NativeDecode
from localllm.engine.lora import LoraSpec, attach_adapters
from localllm.kernels.cpu import decode_lora, decode_step
from localllm.kernels.cpu.block_linear import FLAG_SETS
from localllm.kernels.cpu.cbuild import built_libraries
from tests.lora.test_lora_native import _steps
from tests.perf.bench_lora import make

ROW_MAJOR = "L->bt[s] + c0, L->n[s],\n                       L->hi[s] - L->lo[s], len);"
CHUNKED = "L->bt[s] + c0 * (L->hi[s] - L->lo[s]), LORA_CHUNK, L->hi[s] - L->lo[s], len);"
MARKER = "\nint lora_chunk_major(void) { return 1; }\n"


def test_chunk_major_layout():
    bt = torch.randn(5, 150).half()
    h = decode_lora.chunk_major(bt)
    assert h.shape == (3, 5, 64) and h.is_contiguous()
    for c in range(192):
        want = bt[:, c] if c < 150 else torch.zeros(5, dtype=bt.dtype)
        assert torch.equal(h[c // 64, :, c % 64], want), c


def _chunked_library(tmp: Path):
    """The shipped library when it reads chunk-major B.T, else a copy of its source with the
    expand's one indexing change and the marker, built in `tmp`."""
    lib = decode_step.load()
    if lib is None:
        pytest.skip("no C compiler builds the native decode step")
    if decode_lora.wants_chunks(lib):
        return lib
    src = Path(decode_step.SOURCE)
    for f in [src, *decode_step.SOURCES, *src.parent.glob("*.h")]:
        shutil.copy(f, tmp / Path(f).name)
    text = src.read_text()
    assert ROW_MAJOR in text, "decode_step.c's expand call changed: update ROW_MAJOR"
    (tmp / src.name).write_text(text.replace(ROW_MAJOR, CHUNKED) + MARKER)
    sources = (tmp / src.name, *(tmp / Path(f).name for f in decode_step.SOURCES))
    for lib, _, _ in built_libraries(sources, FLAG_SETS, "localllm-decode-step-chunked",
                                     decode_step._bind_step, tmp / "build"):  # fmt: skip
        return lib
    pytest.fail("the chunk-major copy of decode_step.c did not build")


def _spy(seen: list, real):
    def set_table(lib, table):
        seen.append(table)
        real(lib, table)

    return set_table


def test_chunk_major_step_equals_row_major(smollm2_path, tmp_path, monkeypatch):
    make(argparse.Namespace(model=str(smollm2_path), out=str(tmp_path), rank=4, count=2))
    specs = [LoraSpec(str(tmp_path / f"lora-{k}.gguf")) for k in range(2)]
    chunked = _chunked_library(tmp_path)
    assert decode_lora.wants_chunks(chunked)
    real = decode_lora.set_table
    out = {}
    for name in ("row-major", "chunk-major"):
        gen = Generator.load(str(smollm2_path))
        try:
            attach_adapters(gen.model, specs, gen.gguf, "cpu")
            step = NativeDecode.for_model(gen.model)
            if name == "chunk-major":
                step.lib = chunked
            elif decode_lora.wants_chunks(step.lib):
                pytest.skip("the shipped library reads chunk-major B.T: nothing row-major to test")
            gen.model._native_step = step
            tables = []
            monkeypatch.setattr(decode_lora, "set_table", _spy(tables, real))
            out[name] = _steps(gen, True)
            monkeypatch.setattr(decode_lora, "set_table", real)
            ran = [t for t in tables if t is not None]
            assert ran and all(t.chunked == (name == "chunk-major") for t in ran), name
        finally:
            gen.close()
    assert torch.equal(out["row-major"], out["chunk-major"])
