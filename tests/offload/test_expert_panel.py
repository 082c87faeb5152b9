"""The TUI resource panel's expert-cache line: a model streaming experts through the real engine
backend shows its hit rate and read speed (the counters' exact ratios); resident models: none."""

import asyncio

from localllm.app.tui.engine_backend import EngineBackend
from localllm.app.tui.resources import ExpertCache, Memory, expert_cache
from localllm.app.tui.widgets.resources import render_resources
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.expert_stats import expert_stats
from localllm.offload.residency import resolve
from tests.offload.tiny_moe import write_moe_gguf

GB = 10**9
MEM = Memory(16 * GB, 12 * GB, GB)


def _backend(path, layer):
    cfg = None if layer is None else resolve([("t", layer)])
    backend = EngineBackend.load(path, max_model_len=128, residency=cfg)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def drain():
        async for _ in backend.engine.generate([1, 5, 9, 33], params):
            pass

    asyncio.run(drain())
    return backend


def test_panel_line_for_a_streaming_model(tmp_path):
    path = write_moe_gguf(tmp_path / "moe.gguf")
    backend = _backend(path, {"experts": "disk", "streaming": {"slots": 2, "prefetch": False}})
    try:
        s = expert_stats(backend.engine.engine.model.expert_sources)
        got = expert_cache(backend)
        assert s.lookups > 0 and s.misses > 0
        assert got == ExpertCache(s.hits / s.lookups, s.bytes_read / s.read_seconds / 1e9)
        text = render_resources(MEM, "moe", 1, 12.5, False, got)
        want = f"experts {s.hits / s.lookups:.0%} hits, read {got.read_gbps:.2f} GB/s"
        assert text.splitlines()[-2:] == ["12.5 tok/s", want]
        compact = render_resources(MEM, "moe", 1, 12.5, True, got)
        assert compact.splitlines()[-1] == want
    finally:
        backend.engine.shutdown(True)
    for layer in ({"experts": "device"}, None):  # resident experts: no line
        backend = _backend(path, layer)
        try:
            assert expert_cache(backend) is None
        finally:
            backend.engine.shutdown(True)
    assert expert_cache(None) is None
    assert "experts" not in render_resources(MEM, "moe", 1, 12.5, False, None)
