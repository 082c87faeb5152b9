"""The auto-fit planner on a separate GPU whose kernels read host-tier experts in place: when not
every layer's experts fit on the device and the GPU alone reads the host-tier ones (mapped), all
of them go to host and the device's room becomes an LRU of expert slots over them (measured
faster than split by layer: tests/perf/results/offload.md), unless the user set the slots, the
host cannot hold them all, the room does not give each layer a token's experts, or host experts
are computed on the CPU. Where the CPU computes a share of them (split, and auto's default where
it can) the split by layer stays (measured faster than the slots there)."""

import dataclasses

import pytest
from gguf import GGMLQuantizationType as QT

from localllm.engine.gguf import open_gguf
from localllm.engine.moe import residency as moe_residency
from localllm.engine.moe.residency import CUDA_CONTEXT, plan_model
from localllm.offload.memory import MemoryInfo
from localllm.offload.plan import plan_residency
from localllm.offload.residency import ResidencyError, resolve
from tests.offload.tiny_moe import QWEN3MOE, write_moe_gguf

LAYERS, E, USED, SLOT = 4, 8, 2, 300  # slot: one expert's gate + up + down bytes


def _sizes() -> dict[str, int]:
    sizes = {f"blk.{i}.ffn_{p}_exps.weight": E * SLOT // 3
             for i in range(LAYERS) for p in ("gate", "up", "down")}  # fmt: skip
    sizes["token_embd.weight"] = 1000
    return sizes


def _plan(budget: int, host_free: int = 1 << 30, cache: bool = True, used: int = USED,
          **settings):  # fmt: skip
    gpu = MemoryInfo("cuda:0", host_free=host_free, device_free=1 << 30)
    cfg = resolve([("t", {"budget": budget, **settings})])
    return plan_residency(cfg, _sizes(), 0, gpu, n_expert=E, min_slots=used, host_cache=cache)


def test_layers_that_do_not_all_fit_go_to_host_with_the_room_as_slots():
    # room for two of the four layers' experts (2 x 8 x 300) and a little more
    room = 2 * E * SLOT + 700
    plan = _plan(1000 + room, host_compute="mapped")
    assert set(plan.expert_tiers().values()) == {"host"}
    copy = E * SLOT  # a prompt's copy of one layer stays where it fits
    assert plan.streaming.slots == (room - copy) // SLOT
    assert plan.prompt_copy_bytes == copy
    assert plan.slot_pool_bytes == plan.streaming.slots * SLOT
    assert "the device's room as slots" in "\n".join(plan.notes)
    assert f"expert slots {plan.streaming.slots} x" in plan.describe()
    used = 1000 + plan.slot_pool_bytes + plan.prompt_copy_bytes
    assert used <= plan.budget


@pytest.mark.parametrize("settings", [{"host_compute": "split"}, {}])
def test_where_the_cpu_shares_the_host_layers_the_split_by_layer_stays(settings):
    """Split (asked for, or auto's where the file stays mapped and host RAM holds the copy
    beside it): two layers stay on the device, two on host split with the CPU, no slots; auto
    without the CPU's share (read load mode, host RAM for one copy) takes the slots."""
    plan = _plan(1000 + 2 * E * SLOT + 700, **settings)
    assert sorted(plan.expert_tiers().values()) == ["device", "device", "host", "host"]
    assert not plan.streaming.slots and plan.host_compute == "split"
    if settings:
        return
    assert "(split)" in "\n".join(plan.notes)  # (auto's choice, said)
    # one layer on the device: three on host want twice their bytes of host RAM to share
    for why, other in (("read load mode", {"load_mode": "read"}),
                       ("host RAM for one copy", {"host_free": 6 * E * SLOT - 1})):  # fmt: skip
        cached = _plan(1000 + E * SLOT + 700, **other)
        assert set(cached.expert_tiers().values()) == {"host"}, why
        assert cached.streaming.slots and cached.host_compute == "auto", why


def test_without_room_for_the_copy_the_slots_take_all_of_it():
    room = LAYERS * USED * SLOT + 100  # a token's experts a layer, not a layer's copy on top
    plan = _plan(1000 + room, host_compute="mapped")
    assert plan.streaming.slots == room // SLOT and plan.prompt_copy_bytes == 0


@pytest.mark.parametrize(
    ("why", "kw"),
    [
        ("no cache (kernels do not take the types)", {"cache": False}),
        ("host experts computed by the CPU", {"host_compute": "host"}),
        ("the host cannot hold every layer", {"host_free": 3 * E * SLOT}),
    ],
)
def test_otherwise_the_split_by_layer_stays(why, kw):
    plan = _plan(1000 + 2 * E * SLOT + 700, **kw)
    tiers = plan.expert_tiers()
    assert sorted(tiers.values()).count("device") == 2 and not plan.streaming.slots, why


def test_slots_the_user_set_are_kept():
    plan = _plan(1000 + 2 * E * SLOT + 700, host_compute="mapped", streaming={"slots": 4})
    assert plan.streaming.slots == 4
    assert "the device's room as slots" not in "\n".join(plan.notes)


def test_too_little_room_for_a_tokens_experts_a_layer_stays_split():
    # 4 experts a token: one layer fits (with 4 slots kept), 4 layers x 4 slots (4,800 B) do not
    plan = _plan(1000 + E * SLOT + 4 * SLOT + 10, used=4, host_compute="mapped")
    assert sorted(plan.expert_tiers().values()).count("device") == 1
    assert not plan.streaming.slots


def test_everything_fitting_stays_on_the_device():
    plan = _plan(1000 + LAYERS * E * SLOT + USED * SLOT)  # (with the slots kept for streaming)
    assert set(plan.expert_tiers().values()) == {"device"} and not plan.streaming.slots


def test_plan_model_asks_for_the_cache_only_on_a_cuda_device_with_packed_types(tmp_path):
    """The tiny qwen3moe's Q8_0 experts have packed kernels: a CUDA plan caches, a CPU plan and
    an F32 model do not (their host experts are computed by the CPU)."""
    for qtype, device, want in ((QT.Q8_0, "cuda:0", True), (QT.Q8_0, "cpu", False),
                                (QT.F32, "cuda:0", False)):  # fmt: skip
        spec = dataclasses.replace(QWEN3MOE, expert_qtype=qtype)
        g = open_gguf(write_moe_gguf(tmp_path / f"{qtype.name}.gguf", spec))
        try:
            free = None if device == "cpu" else 1 << 30
            mem = MemoryInfo(device, host_free=1 << 30, device_free=free)
            whole = plan_model(g, resolve([]), memory=mem)
            nbytes = sum(whole.sizes[n] for n in whole.tiers if ".ffn_" in n and "_exps" in n)
            fixed = sum(whole.sizes.values()) - nbytes
            room = nbytes // 2  # half the experts' bytes
            need = fixed + whole.kv_bytes + whole.scratch_bytes + room
            need += CUDA_CONTEXT if device.startswith("cuda") else 0  # (in a given budget)
            cfg = resolve([("t", {"budget": need, "host_compute": "mapped"})])
            plan = plan_model(g, cfg, memory=mem)
        finally:
            g.close()
        cached = bool(plan.streaming.slots) and set(plan.expert_tiers().values()) == {"host"}
        assert cached == want, (qtype, device)


def test_layers_a_rule_put_on_host_count_for_the_slots_each_layer_needs():
    """A rule puts layer 0 on host; the slots are shared by every mapped layer, so the room
    must give all four layers a token's experts (4 x 4 slots here), not only the three placed
    automatically (3 x 4)."""
    rule = {"rules": [r"blk\.0\.ffn_.*_exps=host"]}
    room = 14 * SLOT  # over 3 x 4 and a layer's (8-slot) copy's worth short of 4 x 4
    plan = _plan(1000 + room, used=4, host_compute="mapped", **rule)
    assert not plan.streaming.slots, "under a token's experts for one of the layers"
    roomy = _plan(1000 + 2 * E * SLOT + 4 * SLOT, used=4, host_compute="mapped", **rule)
    assert set(roomy.expert_tiers().values()) == {"host"}
    assert roomy.streaming.slots >= 4 * 4


def test_a_gpu_plan_counts_weights_at_their_blocks_and_a_given_budget_the_cuda_context(tmp_path):
    """On a GPU the linears are used from their blocks (no CPU prepared copy is counted), and a
    given budget, being the process's whole device memory, holds the CUDA context too; free
    memory measured on the device already excludes it."""
    g = open_gguf(write_moe_gguf(tmp_path / "m.gguf", QWEN3MOE))
    try:
        gpu_mem = MemoryInfo("cuda:0", host_free=1 << 30, device_free=1 << 30)
        cpu = plan_model(g, resolve([]), memory=MemoryInfo("cpu", host_free=1 << 30))
        gpu = plan_model(g, resolve([]), memory=gpu_mem)
        linears = [n for n, t in g.tensors.items() if len(t.shape) == 2]
        assert linears
        for n in linears:
            assert gpu.sizes[n] == g.tensors[n].range.nbytes, n
        assert sum(cpu.sizes[n] for n in linears) > sum(gpu.sizes[n] for n in linears)
        assert gpu.runtime_bytes == 0 and "CUDA context" not in gpu.describe()
        fixed = sum(s for n, s in gpu.sizes.items() if "_exps" not in n)
        need = fixed + gpu.kv_bytes + gpu.scratch_bytes + CUDA_CONTEXT
        given = plan_model(g, resolve([("t", {"budget": need + (64 << 20)})]), memory=gpu_mem)
        assert given.runtime_bytes == CUDA_CONTEXT
        assert "(the CUDA context)" in given.describe()
        with pytest.raises(ResidencyError, match="the CUDA context"):
            plan_model(g, resolve([("t", {"budget": need - 1})]), memory=gpu_mem)
    finally:
        g.close()


def test_a_unified_cuda_plan_counts_cublas_workspaces_like_a_separate_one(tmp_path, monkeypatch):
    """cuBLAS's per-stream workspaces come out of a unified GPU's one pool too (they were left
    out there): the scratch is the separate device's, more than a CPU plan's; its experts cost
    their blocks' bytes, as on a separate GPU (it counted the CPU's prepared copies)."""
    # Q8_0 experts without the native CPU kernels: a CPU plan holds them prepared too
    monkeypatch.setattr(moe_residency, "load_native", lambda: None)
    spec = dataclasses.replace(QWEN3MOE, expert_qtype=QT.Q8_0)
    g = open_gguf(write_moe_gguf(tmp_path / "m.gguf", spec))
    try:
        plans = {
            kind: plan_model(g, resolve([]), memory=mem)
            for kind, mem in (
                ("separate", MemoryInfo("cuda:0", host_free=1 << 30, device_free=1 << 30)),
                ("unified", MemoryInfo("cuda:0", host_free=1 << 30, unified=True)),
                ("cpu", MemoryInfo("cpu", host_free=1 << 30)),
            )
        }
    finally:
        g.close()
    assert plans["unified"].scratch_bytes == plans["separate"].scratch_bytes
    assert plans["unified"].scratch_bytes >= plans["cpu"].scratch_bytes + (16 << 20)
    # a unified GPU computes its experts from their blocks, as a separate one does: no CPU copies
    for name, t in g.tensors.items():
        if "_exps." in name:
            assert plans["unified"].sizes[name] == plans["separate"].sizes[name] == t.range.nbytes
            assert plans["cpu"].sizes[name] > t.range.nbytes  # (the CPU's prepared copy)


def _first(budget: int, first=("token_embd.weight",), **settings):
    gpu = MemoryInfo("cuda:0", host_free=1 << 30, device_free=1 << 30)
    sizes = {**_sizes(), "output.weight": 1000}
    # (mapped: the room becomes slots, whose count shows where the embedding's bytes went)
    cfg = resolve([("t", {"budget": budget, "host_compute": "mapped", **settings})])
    return plan_residency(cfg, sizes, 0, gpu, n_expert=E, min_slots=USED, host_cache=True,
                          host_first=first)  # fmt: skip


def test_an_untied_embedding_goes_to_host_first_where_the_experts_do_not_all_fit():
    """The embedding table is read a row per token: where the experts do not all fit on a
    separate device it is read in place from host memory, and its bytes become slots; where
    everything fits, or a rule places it, it stays."""
    experts = LAYERS * E * SLOT
    assert _first(2000 + experts).tiers["token_embd.weight"] == "device"
    tight = _first(2000 + experts // 2)
    assert tight.tiers["token_embd.weight"] == "host"
    assert tight.tiers["output.weight"] == "device"
    assert "token_embd.weight on host, read in place" in "\n".join(tight.notes)
    kept = _first(2000 + experts // 2, first=())
    assert kept.tiers["token_embd.weight"] == "device"
    assert tight.streaming.slots == kept.streaming.slots + 1000 // SLOT
    ruled = _first(2000 + experts // 2, rules=[r"token_embd\.weight=device"])
    assert ruled.tiers["token_embd.weight"] == "device"
    # experts a rule puts on host (--cpu-moe): the device is being saved room for, even if roomy
    assert _first(2000 + experts, cpu_moe=True).tiers["token_embd.weight"] == "host"


def test_a_tied_embedding_on_host_is_refused_and_a_cpu_plan_keeps_it(tmp_path):
    """A file without output.weight multiplies by the embedding table: it must stay on the GPU
    (a rule asking for host is an error); on the CPU the device tier is host RAM anyway."""
    g = open_gguf(write_moe_gguf(tmp_path / "tied.gguf", QWEN3MOE))
    untied = dataclasses.replace(QWEN3MOE, tied=False)
    u = open_gguf(write_moe_gguf(tmp_path / "untied.gguf", untied))
    try:
        gpu = MemoryInfo("cuda:0", host_free=1 << 30, device_free=1 << 30)
        rule = resolve([("t", {"rules": [r"token_embd\.weight=host"]})])
        with pytest.raises(ResidencyError, match="output head too"):
            plan_model(g, rule, memory=gpu)
        assert plan_model(u, rule, memory=gpu).tiers["token_embd.weight"] == "host"
        whole = plan_model(u, resolve([]), memory=gpu)
        experts = sum(s for n, s in whole.sizes.items() if "_exps." in n)
        need = sum(whole.sizes.values()) - experts + whole.kv_bytes + whole.scratch_bytes
        cfg = resolve([("t", {"budget": need + CUDA_CONTEXT + experts // 2})])
        tight = plan_model(u, cfg, memory=gpu)
        assert tight.tiers["token_embd.weight"] == "host"
        assert plan_model(g, cfg, memory=gpu).tiers["token_embd.weight"] == "device"
        cpu = MemoryInfo("cpu", host_free=1 << 30)
        assert plan_model(u, cfg, memory=cpu).tiers["token_embd.weight"] == "device"
    finally:
        g.close()
        u.close()


def test_a_rule_cannot_put_weights_the_device_computes_on_host():
    """Beside a separate device only routed experts (and an untied embedding table, read in
    place) can be on host: a rule putting the output head there is refused instead of a plan
    that leaves out of the device's count a tensor loaded onto it; on the CPU it is no matter."""
    with pytest.raises(ResidencyError, match=r"not output\.weight: their layers compute"):
        _first(10**6, rules=[r"output\.weight=host"])
    ok = _first(10**6, rules=[r"token_embd\.weight=host"])
    assert ok.tiers["token_embd.weight"] == "host"
    cfg = resolve([("t", {"rules": [r"output\.weight=host"]})])
    cpu = MemoryInfo("cpu", host_free=1 << 30)
    plan = plan_residency(cfg, {**_sizes(), "output.weight": 1000}, 0, cpu, n_expert=E)
    assert plan.tiers["output.weight"] == "host"


def test_auto_host_compute_splits_host_experts_with_the_cpu_where_no_slots_cover_them():
    """`host_compute = auto` with host-tier experts and no device slots over them: the CPU
    computes a share of each decode token's experts beside the bus (split); with slots, with
    another setting, in read load mode or without host RAM for the page-locked copy and the
    file's blocks both, it stays as it was."""
    tight = 1000 + E * SLOT + 4 * SLOT + 10  # one layer on the device, no room for slots
    plan = _plan(tight, used=4)
    assert plan.host_compute == "split" and not plan.streaming.slots
    assert "(split)" in "\n".join(plan.notes)
    assert "host_compute = split" in plan.describe()
    hosted = 3 * E * SLOT  # the three layers on host
    cases = [
        ("asked for mapped", _plan(tight, used=4, host_compute="mapped"), "mapped"),
        ("read load mode", _plan(tight, used=4, load_mode="read"), "auto"),
        ("host RAM for one copy", _plan(tight, used=4, host_free=2 * hosted - 1), "auto"),
        ("every expert on the device", _plan(1000 + LAYERS * E * SLOT + 4 * SLOT), "auto"),
    ]
    for why, other, want in cases:
        assert other.host_compute == want, why
    assert _plan(tight, used=4, host_free=2 * hosted).host_compute == "split"
    cpu = MemoryInfo("cpu", host_free=1 << 30)
    cfg = resolve([("t", {"budget": tight})])
    cpu_plan = plan_residency(cfg, _sizes(), 0, cpu, n_expert=E, min_slots=4, host_cache=True)
    assert cpu_plan.host_compute == "auto"
