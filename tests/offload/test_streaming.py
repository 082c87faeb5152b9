"""Expert residency end to end: the slot cache's LRU and counters, token-exact greedy output for
every residency mode, disk-tier experts not held, and a model 4x its budget running under it."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import moe_blocks
from localllm.engine.moe.residency import load_model, plan_model
from localllm.engine.sampling.params import SamplingParams
from localllm.kernels.cpu.native import load as load_native
from localllm.offload.expert_cache import StreamedExperts
from localllm.offload.expert_source import ExpertLayout
from localllm.offload.expert_stats import expert_stats
from localllm.offload.memory import MemoryInfo
from localllm.offload.ranges import ByteRange
from localllm.offload.residency import resolve
from tests.engine.test_deepseek2 import write_deepseek2
from tests.engine.test_gpt_oss import write_gpt_oss
from tests.offload.tiny_moe import MIXTRAL, QWEN3MOE, MoESpec, write_moe_gguf

PROMPT = [1, 5, 9, 33, 7, 11, 200, 3]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MEMORY = MemoryInfo("cpu", host_free=1 << 30)  # a fixed machine: plans do not depend on this box
NATIVE_SPEC = MoESpec(dim=256, expert_ff=256, expert_qtype=QT.Q8_0)


def test_slot_cache_lru_and_counters(tmp_path):
    """Two slots, four experts of 3 x 6 bytes: exact hits/misses, LRU victims, exact bytes."""
    data = bytes(range(256)) * 2
    path = tmp_path / "blob"
    path.write_bytes(data)
    # gate at 16, up at 100, down at 300: each [4 experts, 2 rows, 3 bytes]
    ranges = tuple(ByteRange(str(path), off, 24) for off in (16, 100, 300))
    cache = StreamedExperts({0: ExpertLayout(4, ranges, ((2, 3), (2, 3), (2, 3)))}, slots=2)
    seq = [0, 1, 0, 2, 1, 3, 0, 0]
    hits = []
    for e in seq:
        before = cache.stats.hits
        b = cache.fetch(0, e)
        hits.append(cache.stats.hits > before)
        for blk, off in zip((b.gate, b.up, b.down), (16, 100, 300), strict=True):
            want = torch.tensor(list(data[off + 6 * e : off + 6 * e + 6]), dtype=torch.uint8)
            assert torch.equal(blk.reshape(-1), want)
    # 0 1 miss; 0 hit; 2 evicts 1; 1 evicts 0; 3 evicts 2; 0 evicts 1; 0 hit
    assert hits == [False, False, True, False, False, False, False, True]
    s = cache.stats
    assert (s.lookups, s.hits, s.misses) == (8, 2, 6)
    assert s.bytes_read == 6 * 18 and s.read_gbps > 0
    assert cache.nbytes == 2 * 18


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return {
        "qwen3moe": write_moe_gguf(d / "q.gguf", QWEN3MOE),
        "qwen3moe_q8_0": write_moe_gguf(d / "q8.gguf", MoESpec(expert_qtype=QT.Q8_0), seed=3),
        # 256 wide: the native CPU kernels take these experts (raw blocks, int8 activations)
        "qwen3moe_native": write_moe_gguf(d / "n.gguf", NATIVE_SPEC, seed=4),
        "mixtral": write_moe_gguf(d / "mix.gguf", MIXTRAL, seed=2),
        "deepseek2": write_deepseek2(d / "ds.gguf", seed=4),
        "gpt-oss": write_gpt_oss(d / "oss.gguf", seed=5),
    }


def _run(path: Path, layer: dict | None):
    """Greedy tokens, last-step logits, the model and the routing it did (a list per call)."""
    g = open_gguf(path)
    if layer is None:
        model = build_model(g)  # no plan: the all-resident default
    else:
        plan = plan_model(g, resolve([("test", layer)]), kv_tokens=64, memory=MEMORY)
        model = load_model(g, plan)
    routed: list[int] = []
    for blk in moe_blocks(model):
        route = blk.route

        def counting(x, route=route):
            w, ids = route(x)
            routed.append(len(torch.unique(ids)))  # distinct experts this layer touches
            return w, ids

        blk.route = counting
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    tokens = list(gen.stream(PROMPT, PARAMS))
    logits = gen.score(PROMPT + tokens)
    return tokens, logits, model, sum(routed)


MODES = {
    "experts device": {"experts": "device"},
    "experts host (read)": {"cpu_moe": True, "load_mode": "read"},
    "disk, 2 slots": {"experts": "disk", "streaming": {"slots": 2}},
    "disk, 1 slot, no prefetch": {"experts": "disk", "streaming": {"slots": 1, "prefetch": False}},
    "layer 0 host, rest disk": {"n_cpu_moe": 1, "experts": "disk", "streaming": {"slots": 3}},
}


FAMILIES = ["qwen3moe", "qwen3moe_q8_0", "qwen3moe_native", "mixtral", "deepseek2", "gpt-oss"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_identical_in_every_residency_mode(family, moe_files):
    want_tokens, want_logits, want_model, _ = _run(moe_files[family], None)
    native = [b.native is not None for b in moe_blocks(want_model)]
    assert all(native) if family == "qwen3moe_native" and load_native() else not any(native)
    assert len(set(want_tokens)) > 3  # a real sequence, not one token repeated
    for mode, layer in MODES.items():
        tokens, logits, model, lookups = _run(moe_files[family], layer)
        assert tokens == want_tokens, mode
        assert [b.native is not None for b in moe_blocks(model)] == native, mode
        # same bytes, same kernels, same order: not just close but equal
        assert torch.equal(logits, want_logits), mode
        stats = expert_stats(model.expert_sources)
        assert stats.lookups == lookups, mode  # one lookup per (layer, distinct expert) per step
        assert stats.hits + stats.misses == stats.lookups, mode
        disk = [b for b in moe_blocks(model) if b.ffn_gate_exps.streamed]
        if disk:
            # the disk tier holds no expert blocks; reads are whole experts
            assert all(b.ffn_gate_exps.weight is None for b in disk), mode
            streamed = next(s for s in model.expert_sources if isinstance(s, StreamedExperts))
            streamed.close()  # waits for read-aheads still in flight, so their bytes count
            stats = expert_stats(model.expert_sources)
            reads = stats.misses + stats.prefetched
            assert stats.misses > 0 and stats.bytes_read == reads * streamed.slot_bytes, mode
            assert streamed.n_slots == layer["streaming"]["slots"]
        else:
            assert stats.misses == 0 and stats.bytes_read == 0, mode


def test_more_slots_mean_fewer_misses(moe_files):
    misses = []
    for slots in (1, 4, 16):
        layer = {"experts": "disk", "streaming": {"slots": slots}}
        _, _, model, _ = _run(moe_files["qwen3moe"], layer)
        misses.append(expert_stats(model.expert_sources).misses)
    assert misses[0] > misses[1] > misses[2]
    assert misses[2] <= 16  # 2 layers x 8 experts all fit: each read at most once


BIG = MoESpec(n_layers=4, dim=128, head_dim=32, n_expert=32, expert_ff=1024, expert_qtype=QT.Q8_0)
WARM = replace(BIG, n_layers=1, n_expert=4)  # BIG's shapes, 1.6 MiB of experts
BUDGET = "12MiB"


def _child(model: Path, warmup: Path, layer: dict) -> dict:
    script = Path(__file__).with_name("rss_child.py")
    out = subprocess.run(
        [sys.executable, str(script), str(model), str(warmup), json.dumps(layer)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_model_four_times_its_budget_runs_under_it(tmp_path, moe_files):
    """51 MiB of Q8_0 experts, a 12 MiB budget: experts stream from disk and the process's peak
    RSS grows by less than the budget (measured in a child with getrusage, baseline = RSS
    just before the model is opened, after a warm-up run). The control run holds the experts
    in memory (host tier, read mode) and must blow the same bound: the measurement can fail."""
    big = write_moe_gguf(tmp_path / "big.gguf", BIG)
    warm = write_moe_gguf(tmp_path / "warm.gguf", WARM, seed=1)
    assert BIG.expert_nbytes >= 4 * (12 << 20)
    streamed = _child(big, warm, {"budget": BUDGET})
    assert streamed["budget"] == 12 << 20
    assert not any(streamed["held"]) and streamed["misses"] > 0
    assert streamed["growth"] < streamed["budget"], streamed  # measured 3.7 MiB (2026-12-01)
    held = _child(big, warm, {"cpu_moe": True, "load_mode": "read"})
    assert held["tokens"] == streamed["tokens"]
    assert all(held["held"]) and held["misses"] == 0
    assert held["growth"] > BIG.expert_nbytes > streamed["budget"]


def test_a_given_budget_holds_the_kv_its_plan_reserved(moe_files):
    """With a memory budget, the engine's KV pool is the plan's reservation, not a share of the
    free memory (which the budget may be far below); without one it is sized from what is free."""
    from localllm.engine import LLM

    path = str(moe_files["qwen3moe"])
    llm = LLM(path, max_model_len=64, residency=resolve([("test", {"budget": "64MiB"})]))
    plan, kv = llm.engine.model.residency_plan, llm.engine.kv_plan
    assert kv.nbytes <= max(plan.kv_bytes, 2 * kv.bytes_per_block) < 64 << 20
    free = LLM(path, max_model_len=64, residency=resolve([("test", {})])).engine.kv_plan
    assert free.nbytes > kv.nbytes


def test_closing_the_engine_closes_its_expert_sources(moe_files):
    """The disk tier's threads and open files go with the engine, not with the next GC."""
    from localllm.engine import LLM

    disk = resolve([("test", {"experts": "disk", "streaming": {"slots": 4}})])
    llm = LLM(str(moe_files["qwen3moe"]), max_model_len=64, residency=disk)
    (source,) = llm.engine.model.expert_sources
    assert source._fds
    llm.engine.close()
    assert source._fds == {} and source._readers is None


def test_a_failed_read_the_runner_checks_fails_the_step_before_its_tokens(moe_files):
    """Sources whose reads a GPU asks for are checked once a step's tokens are sampled: an error
    fails the step's requests with it, without that step's tokens (here a stand-in source; the
    GPU path is test_file_experts.py's)."""
    from localllm.engine import LLM, SamplingParams

    llm = LLM(str(moe_files["qwen3moe"]), max_model_len=64)
    calls = []

    class Failing:
        def check(self):
            calls.append(1)
            if len(calls) == 3:
                raise OSError(5, "reading experts failed")

    llm.engine.runner.read_checks.append(Failing())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([[1, 5, 9]], params)
    assert len(calls) == 3  # the prompt's step, a decode step, then the failing one
    assert out.error == "OSError: [Errno 5] reading experts failed"
    assert out.outputs[0].finish_reason == "error" and len(out.outputs[0].token_ids) == 2
