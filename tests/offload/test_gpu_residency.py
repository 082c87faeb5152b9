"""Residency on CUDA (marked `gpu`): the tiny qwen3moe through the engine on the GPU gives the same
greedy tokens with experts on the device, on host (computed on the CPU, or copied per use) and
streamed from disk, and the disk run holds no expert blocks on the device."""

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.engine import LLM, SamplingParams
from localllm.engine.moe.block import account_mapped, graph_safe, moe_blocks
from localllm.engine.runtime.graph_breaks import HostBreaks
from localllm.kernels.cpu.native import load as load_native
from localllm.offload.expert_stats import expert_stats
from localllm.offload.file_experts import FileSlots
from localllm.offload.residency import ResidencyError, resolve
from tests.engine.test_deepseek2 import write_deepseek2
from tests.offload.tiny_moe import QWEN3MOE, write_moe_gguf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = [[1, 5, 9, 33, 7, 11], [200, 3, 3, 17]]


def _greedy(path, layer):
    cfg = None if layer is None else resolve([("test", layer)])
    llm = LLM(str(path), max_model_len=128, device="cuda", residency=cfg)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    graphs = llm.engine.runner.graphs  # decode really went through captured graphs
    assert graphs is not None and graphs.failed is None and graphs.graphs
    split = [b for b in moe_blocks(llm.engine.model) if b.split is not None]
    for g in graphs.graphs.values():  # experts that need the host: a chain of graph pieces
        assert isinstance(g.graph, HostBreaks) != graph_safe(llm.engine.model, split=True)
        if not isinstance(g.graph, HostBreaks):  # split layers hand over by flags in one graph
            assert (g.link is not None) == bool(split)
            assert g.link is None or [s for s, _ in g.link.jobs] == [b.split for b in split]
        if isinstance(g.graph, HostBreaks):
            blocks = moe_blocks(llm.engine.model)  # a split block: a fork and a host step
            pieces = sum(b.packed is None for b in blocks) + 2 * sum(
                b.split is not None for b in blocks
            )
            assert len(g.graph) == pieces + 1
    return out, llm.engine.model


def _near_ties_only(path, want, got):
    """Host compute runs the experts on the CPU (fp16 or int4 prepared weights, float
    activations) where the GPU rounds activations to int8: a token that differs must be a near-tie
    of the precise CPU reference at the first differing position (5 % of the logit range)."""
    from localllm.engine.generator import Generator

    gen = Generator.load(str(path), precise=True)
    try:
        for p, a, b in zip(PROMPTS, want, got, strict=True):
            i = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            if i is not None:
                logits = gen.score(p + a[:i])[-1]
                span = (logits.max() - logits.min()).item()
                gap = abs((logits[a[i]] - logits[b[i]]).item())
                assert gap < 0.05 * span, f"step {i}: {gap:.4f} of a {span:.3f} range: not a tie"
    finally:
        gen.close()


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0])
def test_cuda_tokens_equal_in_every_residency_mode(tmp_path, qtype):
    """F32 experts take the per-expert path; Q8_0 experts the packed dp4a path (resident: grouped
    GEMVs inside the decode graph; streamed or host-copied: packed as fetched, same bits)."""
    path = write_moe_gguf(tmp_path / "moe.gguf", replace(QWEN3MOE, expert_qtype=qtype))
    want, model = _greedy(path, None)
    assert model.blk[0].mlp.ffn_gate_exps.weight.data.device.type == "cuda"
    packed = qtype == QT.Q8_0
    assert all((b.packed is not None) == packed for b in moe_blocks(model))
    assert graph_safe(model) == packed
    for layer in (
        {"experts": "device"},
        # private read copies: uploaded at once, the device's experts packed from the upload
        {"experts": "device", "load_mode": "read"},
        {"cpu_moe": True},
        {"experts": "disk", "streaming": {"slots": 2}},  # 1 a layer: the host asks
        # host-driven read-ahead packs on its own thread (in inference mode; the stream waits)
        {"experts": "disk", "streaming": {"slots": 6, "prefetch": True, "reads": "host"}},
        # misses read at the GPU's request: the decode step is one graph (2 or 4 slots a layer),
        # with or without each layer reading the next one's guesses
        {"experts": "disk", "streaming": {"slots": 4, "reads": "gpu"}},
        {"experts": "disk", "streaming": {"slots": 8, "reads": "gpu"}},
        {"experts": "disk", "streaming": {"slots": 8, "prefetch": True}},
    ):
        st = layer.get("streaming", {})
        if not packed and st.get("reads") == "gpu":
            continue  # (F32 experts have no packed kernels: reads = gpu refuses them)
        got, model = _greedy(path, layer)
        if packed and "cpu_moe" in layer:  # CPU expert math next to the GPU's int8 activations
            _near_ties_only(path, want, got)
        else:
            assert got == want, layer
        if layer.get("load_mode") == "read":
            assert all((b.packed is not None) == packed for b in moe_blocks(model))
        tiers = set(model.residency_plan.expert_tiers().values())
        for blk in moe_blocks(model):
            w = blk.ffn_gate_exps.weight
            if tiers == {"disk"}:
                assert w is None
            else:
                assert w.data.device.type == ("cuda" if tiers == {"device"} else "cpu")
        account_mapped(model)  # (device-side counters come in every few steps)
        s = expert_stats(model.expert_sources)
        assert s.hits + s.misses == s.lookups > 0
        # (auto asks at the GPU where the kernels take the format and a layer's slots hold a
        # token's experts)
        on_request = packed and st.get("reads") != "host" and st.get("slots", 0) // 2 >= 2
        if tiers == {"disk"}:
            assert isinstance(model.expert_sources[0], FileSlots) == on_request, layer
            assert (s.prefetched > 0) == st.get("prefetch", False), layer
        if on_request:  # one graph per decode step; the reader thread really read
            assert graph_safe(model) and s.bytes_read > 0 and s.misses > 0
        elif tiers == {"disk"}:  # packable streamed experts stay packed on the GPU per slot
            assert (model.expert_sources[0].packed_pool is not None) == packed


# deepseek2's tiny file has no tokenizer (LLM needs one); its host dispatch is checked on CPU in
# test_host_compute.py
@pytest.mark.parametrize("family", ["qwen3moe", "qwen3moe_native"])
def test_cuda_host_compute_token_exact(tmp_path, family):
    """Experts on host computed on the CPU (default), copied per use (host_compute = device), or
    split between the GPU reading them mapped and the CPU (split; the CPU's share where the
    native kernels take the format): the same greedy tokens as all on the GPU (near-ties where
    the CPU rounds otherwise); only host compute ships token rows to the CPU (deepseek2: its
    shared experts stay on the GPU and overlap the host experts). qwen3moe_native: 256-wide
    Q8_0 experts, which the native CPU kernels take for decode steps (where a C compiler is
    found)."""
    if family == "deepseek2":
        path = write_deepseek2(tmp_path / "ds.gguf", seed=4)
    elif family == "qwen3moe_native":
        spec = replace(QWEN3MOE, dim=256, expert_ff=256, expert_qtype=QT.Q8_0)
        path = write_moe_gguf(tmp_path / "moe.gguf", spec)
    else:
        path = write_moe_gguf(tmp_path / "moe.gguf")
    want, _ = _greedy(path, None)
    for compute in ("host", "device", "split"):
        got, model = _greedy(path, {"cpu_moe": True, "host_compute": compute})
        if family == "qwen3moe_native":
            _near_ties_only(path, want, got)  # int8 activations on the CPU, the GPU's on the GPU
            native = [b.native is not None for b in moe_blocks(model)]
            assert all(native) if compute == "host" and load_native() else not any(native)
            split = [b.split is not None for b in moe_blocks(model)]
            assert all(split) if compute == "split" and load_native() else not any(split)
        else:
            assert got == want, compute
        assert model.residency_plan.host_compute == compute
        # split maps what the GPU's kernels take (Q8_0 here; F32 experts are computed on the CPU)
        mapped = compute == "split" and family == "qwen3moe_native"
        on_host = compute == "host" or (compute == "split" and not mapped)
        for blk in moe_blocks(model):
            assert blk.ffn_gate_exps.weight.data.device.type == "cpu"
            assert blk.compute_on == (torch.device("cpu") if on_host else None)
            assert (blk.mapped is not None) == mapped
            if blk.split is not None:  # the CPU took its share of every decode token
                assert blk.split.host_rows >= 7 and blk.ffn_gate_exps.weight.nbytes > 0
        rows = expert_stats(model.expert_sources).host_rows
        split = any(b.split is not None for b in moe_blocks(model))
        assert (rows > 0) if on_host or split else rows == 0


def test_cuda_split_over_slots_gives_the_cpu_the_experts_the_slots_miss(tmp_path):
    """Split with device slots over the mapped experts: the CPU's share reads each layer's slot
    map (its pairs are the ones the slots miss, before any other), the slots are hit, the CPU
    takes token rows, and the greedy tokens equal the all-on-GPU run's up to near-ties."""
    if load_native() is None:
        pytest.skip("no C compiler: split has no CPU share")
    spec = replace(QWEN3MOE, dim=256, expert_ff=256, expert_qtype=QT.Q8_0)
    path = write_moe_gguf(tmp_path / "moe.gguf", spec)
    want, _ = _greedy(path, None)
    slots = spec.n_layers * (spec.n_expert - 2)  # most of each layer's experts
    cfg = {"cpu_moe": True, "host_compute": "split", "streaming": {"slots": slots}}
    got, model = _greedy(path, cfg)
    _near_ties_only(path, want, got)
    for b in moe_blocks(model):
        assert b.split is not None and b.split.slot_of is b.mapped.lru.slot_of
        assert b.split.host_rows >= 7
    account_mapped(model)
    st = expert_stats(model.expert_sources)
    assert st.hits > 0 and st.host_rows > 0 and st.lookups == st.hits + st.misses


def test_cuda_streaming_modes_token_exact(tmp_path):
    """Read-ahead on and off, LRU and LFU, few slots: the GPU run's greedy tokens do not change."""
    path = write_moe_gguf(tmp_path / "moe.gguf")
    want, _ = _greedy(path, None)
    for prefetch in (True, False):
        for evict in ("lru", "lfu"):
            st = {"slots": 2, "prefetch": prefetch, "evict": evict}
            got, model = _greedy(path, {"experts": "disk", "streaming": st})
            assert got == want, st
            s = expert_stats(model.expert_sources)
            assert (s.guessed > 0) == prefetch and s.misses > 0, st


def test_cuda_model_four_times_its_device_budget_runs_under_it(tmp_path):
    """Experts read at the GPU's request: a model whose expert bytes are 4x the 128 MiB a budget
    leaves beside the CUDA context (which the plan counts in a given budget and no torch figure
    shows) decodes, and the device memory the process allocates from before the load on (torch's
    peak: weights, slots, maps, scratch, KV, decode graphs, cuBLAS's 32 MiB workspaces) stays
    under those 128 MiB. The control run holds its experts on the device and must blow the same
    bound: the measurement can fail."""
    from localllm.engine.moe.residency import CUDA_CONTEXT
    from tests.offload.test_streaming import BIG

    # 611 MiB of Q8_0 experts in 8 layers of 96
    spec = replace(BIG, n_layers=8, n_expert=96, expert_ff=2048)
    big = write_moe_gguf(tmp_path / "big.gguf", spec)
    budget = 128 << 20
    assert spec.expert_nbytes >= 4 * budget
    peaks, tokens = {}, {}
    for name, layer in (
        (
            "disk",
            {"experts": "disk", "budget": budget + CUDA_CONTEXT, "streaming": {"reads": "gpu"}},
        ),
        ("device", {"experts": "device"}),
    ):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        tokens[name], model = _greedy(big, layer)
        peaks[name] = torch.cuda.max_memory_allocated() - base
        if name == "disk":
            assert isinstance(model.expert_sources[0], FileSlots)
            assert model.residency_plan.budget == budget + CUDA_CONTEXT
        del model
    assert peaks["disk"] < budget, peaks
    assert peaks["device"] > spec.expert_nbytes > budget, peaks
    assert tokens["disk"] == tokens["device"]


def test_cuda_reads_gpu_that_cannot_run_is_an_error(tmp_path):
    """Fewer slots a layer than a token's experts, or experts without packed kernels."""
    path = write_moe_gguf(tmp_path / "moe.gguf", replace(QWEN3MOE, expert_qtype=QT.Q8_0))
    with pytest.raises(ResidencyError, match="fewer than a token's 2 experts"):
        _greedy(path, {"experts": "disk", "streaming": {"slots": 2, "reads": "gpu"}})
    f32 = write_moe_gguf(tmp_path / "f32.gguf", replace(QWEN3MOE, expert_qtype=QT.F32))
    with pytest.raises(ResidencyError, match="kernels take the experts' format"):
        _greedy(f32, {"experts": "disk", "streaming": {"slots": 8, "reads": "gpu"}})


@pytest.mark.parametrize("slots", [0, 3, 8, 16])
def test_cuda_mapped_host_experts_token_exact(tmp_path, slots):
    """Experts on host read by the GPU from mapped host memory (host_compute = mapped), with no
    device slots, a slot per layer (fewer than a step's pairs: the host copy serves), a device
    LRU of half the experts, and room for all: the same kernels over the same bytes, so the
    greedy tokens equal the all-on-GPU run's exactly; the decode is one graph, no token row goes
    to the CPU, and lookups and misses reach the stats."""
    spec = replace(QWEN3MOE, dim=256, expert_ff=256, expert_qtype=QT.Q8_0)
    path = write_moe_gguf(tmp_path / "moe.gguf", spec)
    want, _ = _greedy(path, None)
    cfg = {"cpu_moe": True, "host_compute": "mapped"}
    if slots:
        cfg["streaming"] = {"slots": slots}
    got, model = _greedy(path, cfg)
    assert got == want
    assert graph_safe(model)
    account_mapped(model)
    blocks = moe_blocks(model)
    share = min(slots // len(blocks), spec.n_expert)
    for b in blocks:
        assert b.mapped is not None and b.mapped.slots == share and b.compute_on is None
        assert b.ffn_gate_exps.weight.data.device.type == "cpu"  # (a zero-byte stand-in)
        assert b.mapped.steps > 8  # eager prefill and every graph replay counted
    st = expert_stats(model.expert_sources)
    assert st.host_rows == 0 and st.lookups > 0 and st.lookups == st.hits + st.misses
    assert (st.hits > 0) == (share >= spec.n_used)


def _half_the_experts(path) -> int:
    """A budget (the CUDA context counted) with room for everything but half the experts."""
    from localllm.engine.gguf import open_gguf
    from localllm.engine.moe.residency import CUDA_CONTEXT, plan_model
    from localllm.offload.memory import probe_memory

    g = open_gguf(path)
    try:
        whole = plan_model(g, resolve([]), 128, probe_memory("cuda"))
    finally:
        g.close()
    experts = sum(s for n, s in whole.sizes.items() if "_exps." in n)
    rest = sum(whole.sizes.values()) - experts
    return rest + whole.kv_bytes + whole.scratch_bytes + experts // 2 + CUDA_CONTEXT


def test_cuda_auto_fit_caches_host_experts_in_the_devices_room(tmp_path):
    """A budget with room for half the experts: the planner puts every layer's experts on host
    and that room in device slots over them (not half the layers on the device); the decode is
    one graph, the slots are hit, and the greedy tokens equal the all-on-GPU run's."""
    spec = replace(QWEN3MOE, dim=256, expert_ff=256, expert_qtype=QT.Q8_0)
    path = write_moe_gguf(tmp_path / "moe.gguf", spec)
    want, _ = _greedy(path, None)
    got, model = _greedy(path, {"budget": _half_the_experts(path)})
    plan = model.residency_plan
    assert set(plan.expert_tiers().values()) == {"host"} and plan.streaming.slots > 0
    assert got == want
    assert graph_safe(model)
    account_mapped(model)
    blocks = moe_blocks(model)
    assert all(b.mapped is not None and b.mapped.slots >= spec.n_used for b in blocks)
    st = expert_stats(model.expert_sources)
    assert st.hits > 0 and st.host_rows == 0


def test_cuda_untied_embedding_on_host_is_read_in_place(tmp_path):
    """Where the experts do not all fit, or rules put them off the device, an untied embedding
    table goes to host memory that the GPU reads in place (page-locked, mapped): the lookup
    gathers its rows over the bus inside the decode graph, and the greedy tokens equal the
    all-on-GPU run's."""
    spec = replace(QWEN3MOE, dim=256, expert_ff=256, expert_qtype=QT.Q8_0, tied=False)
    path = write_moe_gguf(tmp_path / "moe.gguf", spec)
    want, model = _greedy(path, None)
    assert not hasattr(model.token_embd.weight.data, "_host_view")
    got, model = _greedy(path, {"budget": _half_the_experts(path)})
    assert model.residency_plan.tiers["token_embd.weight"] == "host"
    rows = model.token_embd.weight.data
    assert rows.is_cuda and rows._host_view.device.type == "cpu"  # the mapped buffer's views
    assert got == want
    assert graph_safe(model)
    # experts a rule puts on host (mapped, read in place): the table leaves the device too
    got, model = _greedy(path, {"cpu_moe": True, "host_compute": "mapped"})
    assert model.residency_plan.tiers["token_embd.weight"] == "host"
    assert got == want


def test_cuda_experts_packed_at_load_leave_no_raw_copy(tmp_path):
    """A model loaded onto the GPU without a plan packs its experts and keeps no raw copy: the
    device memory the load keeps is about the file's bytes, not the experts twice (the layer's
    default source once held the raw copies), and its peak is that plus a chunk of experts in
    flight (16 of the layer's 128, raw and packed, with the packing's temporaries), under a
    layer's bytes (the whole file was once uploaded raw, then packed: a layer over at least)."""
    from tests.engine.load_memory import measured_load
    from tests.offload.test_streaming import BIG

    spec = replace(BIG, n_layers=2, n_expert=128)  # a layer is 8 chunks of 16 experts
    model, file_bytes, kept, peak = measured_load(write_moe_gguf(tmp_path / "big.gguf", spec))
    assert all(b.packed is not None for b in moe_blocks(model))
    assert spec.expert_nbytes > 0.8 * file_bytes  # (the experts are most of the file)
    assert kept < 1.25 * file_bytes, (kept, file_bytes)
    layer = spec.expert_nbytes // spec.n_layers
    assert peak - kept < layer, (peak, kept, layer)


def test_cuda_split_sampled_steps_ahead_equal_one_step_at_a_time(tmp_path):
    """A split residency's sampled steps go one ahead, drawn on the device behind a step whose
    CPU shares the host runs after the draw is queued (nothing there may wait for the device):
    the same seeded tokens as one step at a time."""
    import gc

    if load_native() is None:
        pytest.skip("no C compiler for the native kernels: no split")
    spec = replace(QWEN3MOE, dim=256, expert_ff=256, expert_qtype=QT.Q8_0)
    path = write_moe_gguf(tmp_path / "moe.gguf", spec)
    cfg = resolve([("test", {"cpu_moe": True, "host_compute": "split"})])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)
    got = {}
    for ahead in (False, True):
        llm = LLM(str(path), max_model_len=128, device="cuda", residency=cfg)
        runner = llm.engine.runner
        if not ahead:
            runner.ahead = None
        got[ahead] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], params)]
        assert any(b.split is not None for b in moe_blocks(llm.engine.model))
        if ahead:
            assert runner.ahead.used >= 16 and runner.graphs.failed is None
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert got[True] == got[False]
