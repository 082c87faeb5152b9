"""MoE residency for qwen3next: every residency mode gives the all-resident run's greedy tokens
and logits bit for bit on the llama.cpp-converted Qwen3-Next fixture (routed experts in the
shared MoE block, the gated shared expert beside it, DeltaNet state in its slot, the NextN block
in the file, never planned); `localllm run --cpu-moe` / `--experts disk` print what the default
run prints."""

from types import SimpleNamespace

import pytest
import torch

from localllm.app.cli import main
from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import moe_blocks
from localllm.engine.moe.residency import load_model, plan_model
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.expert_cache import StreamedExperts
from localllm.offload.expert_stats import expert_stats
from localllm.offload.memory import MemoryInfo
from localllm.offload.residency import resolve
from tests.engine.family_goldens import golden, path

NAME = "qwen3next"
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MEMORY = MemoryInfo("cpu", host_free=1 << 30)  # a fixed machine: plans do not depend on this box
MODES = {
    "experts host (read)": {"cpu_moe": True, "load_mode": "read"},
    "disk, 2 slots": {"experts": "disk", "streaming": {"slots": 2}},
    "disk, 1 slot, no prefetch": {"experts": "disk", "streaming": {"slots": 1, "prefetch": False}},
    "layers 0-1 host, rest disk": {"n_cpu_moe": 2, "experts": "disk", "streaming": {"slots": 3}},
}


def _run(layer: dict | None):
    """Greedy tokens and teacher-forced logits from the golden prompt, and the model."""
    g = open_gguf(path(NAME))
    if layer is None:
        model = build_model(g)  # no plan: the all-resident default
    else:
        plan = plan_model(g, resolve([("test", layer)]), kv_tokens=64, memory=MEMORY)
        model = load_model(g, plan)
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    prompt = golden(NAME)["prompt"]["ids"]
    tokens = list(gen.stream(prompt, PARAMS))
    return tokens, gen.score(prompt + tokens), model


def test_greedy_output_identical_in_every_residency_mode():
    want_tokens, want_logits, _ = _run(None)
    assert len(want_tokens) == PARAMS.max_tokens
    for mode, layer in MODES.items():
        tokens, logits, model = _run(layer)
        assert tokens == want_tokens, mode
        assert torch.equal(logits, want_logits), mode  # same bytes, kernels, order: equal
        assert [b.layer for b in moe_blocks(model)] == [0, 1, 2, 3]  # NextN block never built
        stats = expert_stats(model.expert_sources)
        assert stats.hits + stats.misses == stats.lookups > 0, mode
        if layer.get("experts") == "disk" and "n_cpu_moe" not in layer:
            streamed = next(s for s in model.expert_sources if isinstance(s, StreamedExperts))
            streamed.close()  # waits for read-aheads in flight, so their bytes count
            stats = expert_stats(model.expert_sources)
            assert stats.misses > 0 and streamed.n_slots == layer["streaming"]["slots"], mode


def test_plan_leaves_out_the_nextn_block():
    with open_gguf(path(NAME)) as g:
        plan = plan_model(g, resolve([("test", {"experts": "disk"})]), kv_tokens=64, memory=MEMORY)
        assert any(n.startswith("blk.4.") for n in g.tensors)
    assert not any(n.startswith("blk.4.") for n in plan.tiers)
    disk = {n for n, t in plan.tiers.items() if t == "disk"}
    assert disk == {
        f"blk.{i}.ffn_{p}_exps.weight" for i in range(4) for p in ("gate", "up", "down")
    }


@pytest.mark.parametrize("flags", [["--cpu-moe"], ["--experts", "disk", "--expert-slots", "2"]])
def test_cli_runs_print_what_the_default_run_prints(flags, capsys):
    common = ["run", "-m", str(path(NAME)), "--temp", "0", "-n", "12", "--no-chat"]
    common += ["--ignore-eos"]
    assert main([*common, "The capital of France is"]) == 0
    want = capsys.readouterr().out
    assert main([*common, *flags, "-v", "The capital of France is"]) == 0
    got = capsys.readouterr()
    assert got.out == want and len(want) > 0
    if "disk" in flags:
        assert "misses" in got.err and " 0 misses" not in got.err  # it did stream


def test_plan_counts_kv_of_the_attention_layers_only():
    """Only every fourth layer keeps K/V: the plan's KV estimate is that layer's (F16 K and V,
    2 heads of 16, 64 tokens), not four layers' (which would crowd weights off a device)."""
    with open_gguf(path(NAME)) as g:
        plan = plan_model(g, resolve([("test", {})]), kv_tokens=64, memory=MEMORY)
    assert plan.kv_bytes == 1 * 2 * (16 + 16) * 2 * 64
