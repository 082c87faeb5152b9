"""Expert sources of a loaded MoE model (`apply_residency`): each MoE block's experts resident,
host-computed with prepared CPU weights, read in place by the GPU from host memory, split between
the GPU and the CPU, or streamed from disk into slots (kept packed on the GPU where its kernels can
use them), as the residency plan says. Planning and loading are `residency`'s."""

import itertools
import logging

import torch
from torch import nn

from localllm.engine.layers.linear import without_bytes
from localllm.engine.moe.block import MoEFeedForward, moe_blocks
from localllm.engine.moe.split import SPLIT_CPU_SHARE_SLOTS, SplitExperts
from localllm.kernels.cpu.native import load as load_native
from localllm.kernels.cpu.rows_call import RowsScratch
from localllm.offload.expert_cache import StreamedExperts
from localllm.offload.expert_reads import load_library as load_reader
from localllm.offload.expert_source import ExpertLayout, ExpertSource, ResidentExperts
from localllm.offload.file_experts import FileSlots
from localllm.offload.plan import ResidencyPlan
from localllm.offload.residency import ResidencyError

log = logging.getLogger(__name__)


def _on_cpu(b: MoEFeedForward) -> bool:
    """The block computes its routed experts on the CPU (a CPU model, or host compute) with
    prepared experts (precise runs keep the exact raw-block path)."""
    cpu_model = b.ffn_gate_inp.weight.data.device.type == "cpu"
    if cpu_model and b.native is not None:
        return False  # a CPU model's experts through the native kernels: raw blocks only
    on_cpu = cpu_model or b.compute_on is not None
    return on_cpu and not b.precise


def _pack_on(disk: list[MoEFeedForward]) -> torch.device | None:
    """The GPU whose kernels compute the streamed experts, when it can keep them packed."""
    dev = {b.ffn_gate_inp.weight.data.device for b in disk}
    if len(dev) != 1 or next(iter(dev)).type != "cuda":
        return None
    from localllm.kernels.moe.packed import packable  # CUDA only: imports triton

    ok = all(packable(b.format) and b.ffn_gate_exps.bias is None for b in disk)
    return next(iter(dev)) if ok else None


def apply_residency(model: nn.Module, plan: ResidencyPlan) -> list[ExpertSource]:
    """Give every MoE block its expert source from the plan: resident layers share one
    `ResidentExperts`, disk layers a `StreamedExperts` (one per expert format when the slots are
    packed on a GPU; their blocks are then released).
    Host-tier layers of a GPU model are read in place by the GPU (`host_compute` mapped or auto,
    `offload.mapped_experts`) where its kernels take the format, else computed on the CPU
    (`host`) or copied per use (`device`); on a CPU-only run that dispatch moves nothing."""
    tiers = plan.expert_tiers()
    blocks = moe_blocks(model)
    host_tier = [b for b in blocks if tiers.get(b.layer) == "host"]
    maps = plan.host_compute in ("mapped", "auto", "split")
    mapped = [b for b in host_tier if maps and _mappable(b)]
    split = plan.host_compute == "split"
    mapped = _map(mapped, plan.streaming.slots or 0, plan.prompt_copy_bytes > 0, split)
    if split:
        _split(mapped, plan.split_share)
    resident = {b.layer: tuple(w.data for w in b.expert_weights()) for b in blocks}
    disk = [b for b in blocks if tiers.get(b.layer) == "disk"]
    sources: list[ExpertSource] = []
    if disk:
        layouts = {}
        for b in disk:
            layouts[b.layer] = b.stream_layout()
            del resident[b.layer]
        streamed = _stream(disk, layouts, plan)
        sources += streamed
        # each block guesses for the next one when that one streams from the host's side (reads
        # at the GPU's request guess inside the decode graph: `_on_request`)
        if plan.streaming.prefetch and not isinstance(streamed[0], FileSlots):
            for b, nxt in itertools.pairwise(blocks):
                if nxt in disk:
                    b.guess_next = nxt
    if resident:
        # (host experts that could not be mapped are computed on the CPU)
        host = [b for b in host_tier if b not in mapped and plan.host_compute != "device"]
        # a GPU model's host experts: the native CPU kernels where they load and take the format
        on_gpu = bool(host) and host[0].ffn_gate_inp.weight.data.device.type != "cpu"
        native = load_native() if on_gpu else None
        scratch = RowsScratch()  # the host experts' decode calls share their buffers
        for b in host:
            b.rows_scratch = b.rows_scratch or scratch
            f = b.format
            fits = native is not None and b.ffn_gate_exps.bias is None and not b.precise
            ok = fits and native.supports(f.gate, f.up, f.down, f.dim, f.hidden, f.act)
            # (a CPU model's block keeps the kernels it chose at load)
            b.compute_on_host(torch.device("cpu"), native if ok else None if on_gpu else b.native)
        if on_gpu:  # say which CPU kernels the host experts' decode steps take
            n = sum(b.native is not None for b in host)
            how = "torch (no C build)" if native is None else f"native ({' '.join(native.flags)})"
            log.info("host experts: %d of %d layers on %s CPU kernels", n, len(host), how)
        prepared = {b.layer: b.format for b in blocks if b.layer in resident and _on_cpu(b)}
        # (CPU experts the fused kernels do not take run their matrices on the block linears)
        shared = ResidentExperts(resident, prepared, native=load_native() if prepared else None)
        for b in blocks:
            if b.layer in resident:
                b.attach(shared)
        for b in mapped:  # their routing is counted on the device, accounted every few steps
            b.mapped.stats = shared.stats
            if b.split is not None:  # the CPU's pairs: counted as served where they are
                b.split.stats = shared.stats
        sources.append(shared)
    return sources


def _mappable(b: MoEFeedForward) -> bool:
    """A GPU model's block whose experts the packed kernels can read from mapped host memory."""
    if b.ffn_gate_inp.weight.data.device.type != "cuda" or b.precise:
        return False
    from localllm.kernels.moe.packed import packable  # CUDA only: imports triton

    return packable(b.format) and b.ffn_gate_exps.bias is None


def _map(
    blocks: list[MoEFeedForward], slots: int, copy: bool, keep_raw: bool = False
) -> list[MoEFeedForward]:
    """Host-tier experts into mapped host memory, `slots` device slots shared out by layer,
    `copy`: prompts copy a layer's experts to the device, `keep_raw`: the file's blocks stay
    for the CPU (split); the blocks mapped (where page-locking fails, the rest stay for the CPU
    to compute)."""
    if not blocks:
        return []
    share, done = slots // len(blocks), []
    for b in blocks:
        try:
            b.map_experts(share, copy, keep_raw)
        except RuntimeError as e:  # e.g. no page-locked memory left: the CPU computes the rest
            log.warning("host experts: mapping layer %d failed (%s); the CPU computes the "
                        "remaining %d layers", b.layer, e, len(blocks) - len(done))  # fmt: skip
            break
        done.append(b)
    cached = f", {share} device slots each (LRU)" if share else ""
    n = len(done)
    log.info("host experts: %d layers read by the GPU from mapped host memory%s", n, cached)
    return done


def _split(blocks: list[MoEFeedForward], share: float | None = None) -> None:
    """Mapped blocks whose CPU also computes a share of each decode token's experts from the
    file's blocks (`engine.moe.split`), where the native kernels load and take the format; the
    rest stay mapped alone (their raw blocks released). `share`: the plan's (None: the
    defaults, one without device slots and one with)."""
    native = load_native() if blocks else None
    scratch = RowsScratch()  # the layers' CPU shares run one at a time: one set of buffers
    n = 0
    for b in blocks:
        f = b.format
        if native is not None and native.supports(f.gate, f.up, f.down, f.dim, f.hidden, f.act):
            raw = tuple(w.data for w in b.expert_weights())
            dev = b.ffn_gate_inp.weight.data.device
            cached = b.mapped.lru is not None
            given = share if share is not None else SPLIT_CPU_SHARE_SLOTS if cached else None
            b.split = SplitExperts(native, raw, (f.gate, f.up, f.down), f.act, f.dim, b.n_used,
                                   given, dev, b.layer, scratch)  # fmt: skip
            b.mapped.n_used = b.n_used - b.split.cpu  # replays count the bus's pairs
            if cached:  # the CPU takes the pairs the slots miss
                b.split.slot_of = b.mapped.lru.slot_of
            n += 1
        else:
            for t in (b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps):
                t.weight = without_bytes(t.weight)
    if blocks:
        how = "no native CPU kernels" if native is None else f"native ({' '.join(native.flags)})"
        log.info("host experts: %d of %d mapped layers split with the CPU (%s)",
                 n, len(blocks), how)  # fmt: skip


def _stream(
    disk: list[MoEFeedForward], layouts: dict[int, ExpertLayout], plan: ResidencyPlan
) -> list[StreamedExperts | FileSlots]:
    """The disk layers' slot caches: one `FileSlots` (`_on_request`), or `StreamedExperts`:
    one, or where the slots are packed on a GPU, one per expert format (a packed pool holds
    one format), the slots shared out by layer count."""
    st = plan.streaming
    prepare = all(_on_cpu(b) for b in disk)  # a device model gets its disk experts raw
    pack_on = _pack_on(disk)
    on_request = _on_request(disk, layouts, plan, pack_on)
    if on_request is not None:
        return [on_request]
    groups: dict[object, list[MoEFeedForward]] = {}
    for b in disk:
        groups.setdefault(b.format if pack_on is not None else None, []).append(b)
    sources = []
    native = load_native() if prepare else None  # as the resident experts' (same bits)
    for group in groups.values():
        share = max(1, st.slots * len(group) // len(disk))
        mine = {b.layer: layouts[b.layer] for b in group}
        streamed = StreamedExperts(mine, share, st.prefetch, st.evict, prepare, pack_on,
                                   n_used=group[0].n_used, native=native)  # fmt: skip
        for b in group:
            b.attach(streamed)
            for t in (b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps):
                t.release()
        sources.append(streamed)
    return sources


def _on_request(
    disk: list[MoEFeedForward], layouts: dict[int, ExpertLayout], plan: ResidencyPlan, pack_on
) -> FileSlots | None:
    """The disk layers' experts read at the GPU's request into per-layer device slots
    (`offload.file_experts`: decode stays one CUDA graph), where `[streaming] reads` allows it
    and it can run; else None (the host-driven `StreamedExperts`). `reads = gpu` that cannot
    run is an error. With prefetch, each layer's decode step reads the next layer's guessed
    experts (its router on this layer's input) while it computes."""
    st = plan.streaming
    if pack_on is None or st.reads == "host":
        if st.reads == "gpu":
            raise ResidencyError("reads = gpu needs a GPU whose kernels take the experts' format")
        return None
    share, n_used = (st.slots or 0) // len(disk), max(b.n_used for b in disk)
    why = f"{share} slots a layer hold fewer than a token's {n_used} experts"
    why = why if share < n_used else ""
    lib = None if why else load_reader()
    if not why and lib is None:
        why = "no C compiler builds the reader"
    if why:
        if st.reads == "gpu":
            raise ResidencyError(f"reads = gpu: {why}")
        log.info("streamed experts: read at the host's request (%s)", why)
        return None
    cap = min(share, plan.request_stage)  # (the plan's `_staged`)
    shared = FileSlots(layouts, cap, pack_on, lib, prompt_copy=plan.prompt_copy_bytes > 0,
                       in_place=plan.memory.unified)  # fmt: skip
    for b in disk:
        b.request_experts(layouts[b.layer], share, shared)
        b.attach(shared)
    for b, nxt in itertools.pairwise(disk):  # each layer's step reads the next one's guesses
        if st.prefetch and nxt.layer == b.layer + 1:
            b.read_ahead_next, b.mapped.ahead = nxt, nxt.mapped
    log.info("streamed experts: %d layers, %d device slots each, read at the GPU's request",
             len(disk), share)  # fmt: skip
    return shared
