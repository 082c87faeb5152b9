"""MoE residency for Hugging Face folders as for GGUFs: on the tiny qwen3moe folder (transformers,
fixed seed, `hf_fixtures`), as stored (bf16) and with `--quantize q8_0`, every residency mode
(experts on host, streamed from disk with few slots, a memory budget that leaves part of them
on disk) gives the all-resident run's greedy tokens and logits bit for bit; the disk tier's
experts (stacked, or quantized, at load) come from a spill file written once and mapped again by
the next load; `localllm run --cpu-moe` / `--experts disk` on the folder print what the default
run prints."""

from types import SimpleNamespace

import pytest
import torch

from localllm.app.cli import main
from localllm.engine.generator import Generator
from localllm.engine.hf import open_hf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import moe_blocks
from localllm.engine.moe.residency import load_model, plan_model
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.expert_cache import StreamedExperts
from localllm.offload.expert_stats import expert_stats
from localllm.offload.memory import MemoryInfo
from localllm.offload.residency import resolve
from tests.engine.hf_fixtures import available, save_tiny

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
MEMORY = MemoryInfo("cpu", host_free=1 << 30)  # a fixed machine: plans do not depend on this box
PROMPT = [5, 17, 42, 99, 7, 250, 31]
MODES = {
    "cpu-moe": {"cpu_moe": True},
    "experts host (read)": {"experts": "host", "load_mode": "read"},
    "disk, 2 slots": {"experts": "disk", "streaming": {"slots": 2}},
    "disk, 1 slot, no prefetch": {"experts": "disk", "streaming": {"slots": 1, "prefetch": False}},
    "layer 0 host, layer 1 disk": {"n_cpu_moe": 1, "experts": "disk", "streaming": {"slots": 2}},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return save_tiny("qwen3moe", tmp_path_factory.mktemp("hfmoe") / "qwen3moe")


def _run(folder, quantize, layer=None, budget=None):
    """Greedy tokens and teacher-forced logits from PROMPT, the model and its plan."""
    ck = open_hf(folder, quantize)
    plan = None
    if layer is None and budget is None:
        model = build_model(ck)  # no plan: the all-resident default
    else:
        layers = [("test", layer)] if layer else []
        layers += [("budget", {"budget": budget})] if budget else []
        plan = plan_model(ck, resolve(layers), kv_tokens=64, memory=MEMORY)
        model = load_model(ck, plan)
    gen = Generator(ck, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    tokens = list(gen.stream(PROMPT, PARAMS))
    return tokens, gen.score(PROMPT + tokens), model, plan


def _close_streams(model) -> None:
    for s in model.expert_sources:
        if isinstance(s, StreamedExperts):
            s.close()  # waits for read-aheads in flight, so their bytes count


@pytest.mark.parametrize("quantize", [None, "q8_0"])
def test_every_residency_mode_gives_the_resident_output(folder, quantize):
    want_tokens, want_logits, _, _ = _run(folder, quantize)
    assert len(want_tokens) == PARAMS.max_tokens and len(set(want_tokens)) > 1
    for mode, layer in MODES.items():
        tokens, logits, model, plan = _run(folder, quantize, layer)
        assert tokens == want_tokens, mode
        assert torch.equal(logits, want_logits), mode  # same bytes, kernels, order: equal
        blocks = moe_blocks(model)
        assert [b.layer for b in blocks] == [0, 1]
        _close_streams(model)
        stats = expert_stats(model.expert_sources)
        assert stats.hits + stats.misses == stats.lookups > 0, mode
        disk = [b for b in blocks if plan.expert_tiers()[b.layer] == "disk"]
        if layer.get("experts") == "disk":
            assert disk and all(b.ffn_gate_exps.weight is None for b in disk), mode
            assert stats.misses > 0 and stats.bytes_read > 0, mode  # it did stream
        else:
            assert not disk and stats.misses == 0 and stats.bytes_read == 0, mode


@pytest.mark.parametrize("quantize", [None, "q8_0"])
def test_a_memory_budget_leaves_part_of_the_experts_on_disk(folder, quantize):
    want_tokens, want_logits, _, _ = _run(folder, quantize)
    with open_hf(folder, quantize) as ck:
        full = plan_model(ck, resolve([]), kv_tokens=64, memory=MEMORY)
    experts = sum(n for name, n in full.sizes.items() if "_exps." in name)
    # room for everything but a quarter of the experts' bytes (a layer's half, less its slots)
    budget = full.bytes_by_tier()["device"] + full.kv_bytes + full.scratch_bytes - experts // 4
    tokens, logits, model, plan = _run(folder, quantize, budget=budget)
    tiers = plan.expert_tiers()
    assert plan.budget == budget and set(tiers.values()) == {"device", "disk"}, tiers
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)
    _close_streams(model)
    assert expert_stats(model.expert_sources).misses > 0


def test_disk_tier_spill_file_is_written_once(folder):
    """The experts stacked (and quantized) at load are written to `<folder>/.localllm/` by the
    first load and mapped, unchanged, by the next; another `--quantize` gets its own file."""
    layer = {"experts": "disk", "streaming": {"slots": 2}}
    for quantize in (None, "q8_0"):
        _run(folder, quantize, layer)
    spills = sorted((folder / ".localllm").glob("spill-*.bin"))
    assert len(spills) == 2
    stamps = [p.stat().st_mtime_ns for p in spills]
    _, _, model, _ = _run(folder, "q8_0", layer)
    _close_streams(model)
    assert [p.stat().st_mtime_ns for p in spills] == stamps
    assert sorted((folder / ".localllm").glob("spill-*")) == spills  # no partial file left


@pytest.mark.parametrize("flags", [["--cpu-moe"], ["--experts", "disk", "--expert-slots", "2"],
                                   ["--quantize", "q8_0", "--experts", "disk"]])  # fmt: skip
def test_cli_runs_print_what_the_default_run_prints(folder, flags, capsys):
    common = ["run", "-m", str(folder), "--temp", "0", "-n", "10", "--no-chat", "--ignore-eos"]
    quant = flags[:2] if flags[0] == "--quantize" else []
    assert main([*common, *quant, "Hello, world! The quick"]) == 0
    want = capsys.readouterr().out
    assert main([*common, *flags, "-v", "Hello, world! The quick"]) == 0
    got = capsys.readouterr()
    assert got.out == want and len(want) > 0
    if "disk" in flags:
        assert "misses" in got.err and " 0 misses" not in got.err  # it did stream


@pytest.mark.parametrize("quantize", [None, "q8_0"])
def test_glm4moe_folder_streams_its_experts(tmp_path_factory, quantize):
    """The GLM-4.5-shaped folder (a dense first layer, shared experts, the choice bias, a NextN
    layer in the file that is never planned nor read): experts on host or streamed from disk
    give the resident run's output bit for bit."""
    transformers = pytest.importorskip("transformers")
    if not available("glm4moe"):
        pytest.skip(f"transformers {transformers.__version__} lacks Glm4MoeForCausalLM")
    glm = tmp_path_factory.getbasetemp() / "glm4moe"
    if not glm.exists():
        save_tiny("glm4moe", glm)
    want_tokens, want_logits, _, _ = _run(glm, quantize)
    for layer in ({"cpu_moe": True}, {"experts": "disk", "streaming": {"slots": 2}}):
        tokens, logits, model, plan = _run(glm, quantize, layer)
        assert tokens == want_tokens and torch.equal(logits, want_logits), layer
        assert sorted(plan.expert_tiers()) == [1, 2]  # not the dense layer 0, not NextN's 3
        _close_streams(model)
        misses = expert_stats(model.expert_sources).misses
        assert (misses > 0) == (layer.get("experts") == "disk"), layer


@pytest.mark.parametrize("command", ["run", "bench"])
def test_show_plan_on_a_folder(folder, command, capsys):
    """`--show-plan` reads a folder as it reads a GGUF (it used to ask for a .gguf file)."""
    flags = ["-m", str(folder), "--quantize", "q8_0", "--experts", "disk", "--show-plan"]
    assert main([command, *flags]) == 0
    out = capsys.readouterr().out
    assert "-> disk" in out and "experts of layers 0-1 placed by rules" in out


def test_hf_cache_snapshot_keeps_only_repo_files(folder, tmp_path):
    """In the Hugging Face cache layout the spill goes beside the snapshots, so a snapshot holds
    the repo's files alone (what `localllm ls` / `rm` read)."""
    import shutil

    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(folder, snap, ignore=shutil.ignore_patterns(".localllm"))
    before = sorted(p.name for p in snap.rglob("*"))
    tokens, _, model, _ = _run(snap, "q8_0", {"experts": "disk", "streaming": {"slots": 2}})
    _close_streams(model)
    assert sorted(p.name for p in snap.rglob("*")) == before
    assert len(list((tmp_path / "models--org--tiny" / ".localllm" / "abc123").glob("spill-*"))) == 1
    assert tokens == _run(folder, "q8_0")[0]
