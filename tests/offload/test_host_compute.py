"""Host-tier experts computed on the host: the plan declares it (`host_compute`), `--show-plan`
says it, and the dispatch (token rows to the CPU, result back) gives exactly the resident run's
logits for plain, shared-expert (deepseek2) and biased (gpt-oss) MoE blocks."""

from types import SimpleNamespace

import pytest
import torch

from localllm.app.cli import build_parser
from localllm.app.residency_flags import residency_config
from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import moe_blocks
from localllm.engine.moe.residency import load_model, plan_model
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.expert_stats import expert_stats
from localllm.offload.memory import MemoryInfo
from localllm.offload.plan import fmt_bytes, plan_residency
from localllm.offload.residency import ResidencyError, resolve
from tests.engine.test_deepseek2 import write_deepseek2
from tests.engine.test_gpt_oss import write_gpt_oss
from tests.offload.tiny_moe import write_moe_gguf

PROMPT = [1, 5, 9, 33, 7, 11, 200, 3]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CPU = MemoryInfo("cpu", host_free=1 << 30)
GPU = MemoryInfo("cuda:0", host_free=1 << 30, device_free=1 << 30)  # a plan for a device


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostc")
    return {
        "qwen3moe": write_moe_gguf(d / "q.gguf"),
        "deepseek2": write_deepseek2(d / "ds.gguf", seed=4),
        "gpt-oss": write_gpt_oss(d / "oss.gguf", seed=5),
    }


def _run(path, layer: dict | None):
    g = open_gguf(path)
    if layer is None:
        model = build_model(g)
    else:
        model = load_model(g, plan_model(g, resolve([("t", layer)]), 64, CPU))
    rows = [0]
    for blk in moe_blocks(model):
        route = blk.route

        def counting(x, route=route):
            rows[0] += x.reshape(-1, x.shape[-1]).shape[0]
            return route(x)

        blk.route = counting
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    tokens = list(gen.stream(PROMPT, PARAMS))
    return tokens, gen.score(PROMPT + tokens), model, rows[0]


@pytest.mark.parametrize("family", ["qwen3moe", "deepseek2", "gpt-oss"])
def test_host_compute_dispatch_is_exact(family, files):
    want_tokens, want_logits, _, _ = _run(files[family], None)
    for compute in ("host", "device"):
        tokens, logits, model, rows = _run(
            files[family], {"cpu_moe": True, "host_compute": compute}
        )
        assert tokens == want_tokens, compute
        assert torch.equal(logits, want_logits), compute
        on_host = [b.compute_on for b in moe_blocks(model)]
        host_rows = expert_stats(model.expert_sources).host_rows
        if compute == "host":  # every MoE layer went through the host dispatch, every row
            assert on_host == [torch.device("cpu")] * len(on_host)
            assert host_rows == rows > 0
        else:
            assert on_host == [None] * len(on_host) and host_rows == 0


def test_only_host_tier_layers_compute_on_host(files):
    _, _, model, _ = _run(files["qwen3moe"], {"n_cpu_moe": 1})
    assert [b.compute_on for b in moe_blocks(model)] == [torch.device("cpu"), None]


def test_plan_declares_host_compute():
    sizes = {f"blk.0.ffn_{p}_exps.weight": 100 for p in ("gate", "up", "down")}
    sizes["token_embd.weight"] = 10
    texts = (
        ("host", "computed on the CPU"),
        ("device", "copied to the device"),
        ("split", "read in place by the device from page-locked host memory while the CPU"),
    )
    for compute, text in texts:
        cfg = resolve([("t", {"cpu_moe": True, "host_compute": compute})])
        plan = plan_residency(cfg, sizes, 0, GPU)
        assert plan.host_compute == compute and plan.computes_on_host == (compute == "host")
        assert f"host-tier experts: {text}" in plan.describe()
    cpu_plan = plan_residency(resolve([("t", {"cpu_moe": True})]), sizes, 0, CPU)
    assert "host RAM is the compute device" in cpu_plan.describe()
    no_host = plan_residency(resolve([("t", {"experts": "device"})]), sizes, 0, GPU)
    assert "host-tier experts" not in no_host.describe() and not no_host.computes_on_host


def test_host_compute_flag_env_and_bad_value(tmp_path):
    def parse(*flags):
        return build_parser().parse_args(["run", "-m", "x.gguf", *flags, "hi"])

    assert residency_config(parse(), env={}).host_compute == "auto"  # the default
    env = {"LOCALLLM_HOST_COMPUTE": "device"}
    assert residency_config(parse(), env=env).host_compute == "device"
    assert residency_config(parse("--host-compute", "host"), env=env).host_compute == "host"
    doc = tmp_path / "r.toml"
    doc.write_text('host_compute = "gpu"\n')
    with pytest.raises(
        ResidencyError, match="host_compute must be one of auto, host, device, mapped, split"
    ):
        residency_config(parse("--residency", str(doc)), env={})
    with pytest.raises(SystemExit):
        parse("--host-compute", "gpu")


def test_plan_of_mapped_host_experts_counts_their_device_slots():
    """host_compute = mapped: the device slots caching recently used host experts are part of the
    plan's device use and must fit the budget; without slots the plan keeps no device bytes
    for them; on a CPU-only box nothing is mapped."""
    sizes = {f"blk.{i}.ffn_{p}_exps.weight": 800 for i in (0, 1) for p in ("gate", "up", "down")}
    sizes["token_embd.weight"] = 10
    cfg = resolve([("t", {"cpu_moe": True, "host_compute": "mapped", "streaming": {"slots": 4}})])
    plan = plan_residency(cfg, sizes, 0, GPU, n_expert=8)
    assert plan.maps and not plan.computes_on_host and not plan.streams
    assert plan.slot_bytes == 3 * 800 // 8 and plan.slot_pool_bytes == 4 * 300
    text = plan.describe()
    assert "read in place by the device from page-locked host memory" in text
    assert "expert slots 4 x" in text and "recently used host-tier experts (LRU)" in text
    bare = resolve([("t", {"cpu_moe": True, "host_compute": "mapped"})])
    assert plan_residency(bare, sizes, 0, GPU).slot_pool_bytes == 0
    many = {"cpu_moe": True, "host_compute": "mapped", "streaming": {"slots": 10**7}}
    big = resolve([("t", many)])
    with pytest.raises(ResidencyError, match=r"expert slots .* do not fit"):
        plan_residency(big, sizes, 0, GPU, n_expert=8)
    assert not plan_residency(cfg, sizes, 0, CPU).maps


def test_plan_makes_room_for_a_prompts_copy_of_one_mapped_layer():
    """Mapped host experts: a prompt copies one layer's experts to the device where the budget
    has room after the slots (counted in the plan's use, said in its text); where it has not,
    prompts read in place and the notes say so."""
    sizes = {f"blk.{i}.ffn_{p}_exps.weight": 800 for i in (0, 1) for p in ("gate", "up", "down")}
    sizes["token_embd.weight"] = 10
    roomy = {"cpu_moe": True, "host_compute": "mapped", "streaming": {"slots": 4}}
    plan = plan_residency(resolve([("t", roomy)]), sizes, 0, GPU, n_expert=8)
    assert plan.prompt_copy_bytes == 8 * 300  # a layer: its 8 experts of 300 bytes
    text = plan.describe()
    assert "prompt copy 2.34 KiB on the device" in text
    assert "planned use 3.53 KiB" in text  # 10 + 4 slots x 300 + 2,400
    tight = resolve([("t", {**roomy, "budget": "2000"})])  # the slots fit, a layer does not
    plan = plan_residency(tight, sizes, 0, GPU, n_expert=8)
    assert plan.prompt_copy_bytes == 0 and "prompt copy" not in plan.describe()
    assert any("read the host-tier experts in place" in n for n in plan.notes)
    assert plan_residency(resolve([("t", {"cpu_moe": True})]), sizes, 0, CPU).prompt_copy_bytes == 0


def test_mapping_that_fails_leaves_the_rest_to_the_cpu(caplog):
    """Page-locking can fail (no pinned memory left): the layers mapped so far stay mapped,
    the rest are handed back for the CPU to compute, with a warning that says so."""
    from localllm.engine.moe.sources import _map

    class Block:
        def __init__(self, layer, fails):
            self.layer, self.fails, self.share = layer, fails, None

        def map_experts(self, share, copy, keep_raw=False):
            if self.fails:
                raise RuntimeError("cudaHostRegister of 1,024 bytes failed (cudaError 2)")
            self.share = share

    blocks = [Block(0, False), Block(1, True), Block(2, False)]
    with caplog.at_level("WARNING"):
        done = _map(blocks, slots=7, copy=False)
    assert done == blocks[:1] and blocks[0].share == 7 // 3 and blocks[2].share is None
    assert "mapping layer 1 failed" in caplog.text and "remaining 2 layers" in caplog.text
    assert _map([], slots=4, copy=True) == []


def test_plan_of_streamed_experts_on_a_gpu_counts_the_packing_maps():
    """Disk-tier experts on a separate device are packed into a device slot pool through byte
    maps of four bytes per byte of one expert, and cross into device scratch of up to
    REQUEST_STAGE experts (at most a layer's share of the slots): part of the slot pool's
    bytes, of the text, and of what auto-sized slots leave room for (at least a token's experts
    per disk layer for reads at the GPU's request); a CPU-only plan has neither."""
    from localllm.offload.plan import PACKING_MAPS, REQUEST_STAGE

    sizes = {f"blk.{i}.ffn_{p}_exps.weight": 800 for i in (0, 1) for p in ("gate", "up", "down")}
    sizes["token_embd.weight"] = 10
    cfg = resolve([("t", {"experts": "disk", "streaming": {"slots": 4}})])
    plan = plan_residency(cfg, sizes, 0, GPU, n_expert=8)
    extra = (PACKING_MAPS + min(REQUEST_STAGE, 4 // 2)) * 300  # (staged: a layer's share)
    assert plan.streams and plan.packing_maps_bytes == extra
    assert plan.slot_pool_bytes == 4 * 300 + extra
    assert f"+ {fmt_bytes(extra)} of packing maps and staging" in plan.describe()
    on_cpu = plan_residency(cfg, sizes, 0, CPU, n_expert=8)
    assert on_cpu.packing_maps_bytes == 0 and on_cpu.slot_pool_bytes == 4 * 300
    auto = resolve([("t", {"experts": "disk", "budget": 10 + 10 * 300})])
    slots = plan_residency(auto, sizes, 0, GPU, n_expert=8).streaming.slots
    assert slots == 2  # one a layer (min_slots 1) x 2 disk layers; no room for a prompt copy
    roomy = resolve([("t", {"experts": "disk", "budget": 10 + 60 * 300})])
    plan = plan_residency(roomy, sizes, 0, GPU, n_expert=8)
    # room for a layer's prompt copy (raw and packed: 2 x 8 experts) and the staging
    assert plan.prompt_copy_bytes == 16 * 300
    assert plan.streaming.slots == 60 - PACKING_MAPS - 16 - REQUEST_STAGE


def test_plan_stages_a_tokens_experts_when_a_model_routes_more_than_request_stage():
    """A model routing more experts a token than REQUEST_STAGE stages that many per request (the
    engine's reader is sized from the plan): the plan counts those bytes, not REQUEST_STAGE's."""
    from localllm.offload.plan import PACKING_MAPS, REQUEST_STAGE

    sizes = {f"blk.{i}.ffn_{p}_exps.weight": 800 for i in (0, 1) for p in ("gate", "up", "down")}
    cfg = resolve([("t", {"experts": "disk", "streaming": {"slots": 2 * 20}})])
    wide = plan_residency(cfg, sizes, 0, GPU, n_expert=8, min_slots=REQUEST_STAGE + 4)
    assert wide.request_stage == REQUEST_STAGE + 4
    assert wide.packing_maps_bytes == (PACKING_MAPS + REQUEST_STAGE + 4) * 300
    narrow = plan_residency(cfg, sizes, 0, GPU, n_expert=8, min_slots=8)
    assert narrow.request_stage == REQUEST_STAGE
    assert narrow.packing_maps_bytes == (PACKING_MAPS + REQUEST_STAGE) * 300


def test_plan_of_streamed_experts_on_unified_memory_counts_maps_staging_and_the_prompt_copy():
    """A CUDA device on unified memory (one pool) packs streamed experts through byte maps too,
    its staging rows are in that pool, and prompts copy a layer where the budget has room; a CPU
    plan counts none of them."""
    from localllm.offload.plan import PACKING_MAPS

    sizes = {f"blk.{i}.ffn_{p}_exps.weight": 800 for i in (0, 1) for p in ("gate", "up", "down")}
    sizes["token_embd.weight"] = 10
    unified = MemoryInfo("cuda:0", host_free=10 + 60 * 300, unified=True)
    cfg = resolve([("t", {"experts": "disk", "streaming": {"slots": 4}})])
    plan = plan_residency(cfg, sizes, 0, unified, n_expert=8, min_slots=2)
    assert plan.packing_maps_bytes == (PACKING_MAPS + 4 // 2) * 300  # (staged: a layer's share)
    assert plan.prompt_copy_bytes == 2 * 8 * 300
    assert "reads auto" in plan.describe()
    on_cpu = plan_residency(cfg, sizes, 0, MemoryInfo("cpu", host_free=10 + 60 * 300),
                            n_expert=8, min_slots=2)  # fmt: skip
    assert on_cpu.packing_maps_bytes == 0 and on_cpu.prompt_copy_bytes == 0
