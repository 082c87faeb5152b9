"""The residency planner: a tier for every tensor, a KV budget and an expert slot pool.

Inputs are the model's tensor sizes (names as in the GGUF), a KV-cache estimate, the resolved
`ResidencyConfig` and measured free memory; nothing is read from the weights. Rules decide first
(first match wins); the auto-fit then places what is left: non-expert weights on the device
(they must fit with the KV cache, or the plan fails with the numbers), then routed experts layer
by layer on the device, on host (when the device has its own memory), or on disk, streamed
through a slot pool sized from what the budget leaves.
"""

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from localllm.offload.memory import MemoryInfo
from localllm.offload.residency import ResidencyConfig, ResidencyError, Streaming

_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_EXPERT_BIAS = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.bias$")


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _disk_layers(tiers: Mapping[str, str]) -> int:
    """Layers whose routed experts are on disk."""
    return len({expert_layer(n) for n, t in tiers.items() if t == "disk"} - {None})


def _packs(memory: MemoryInfo) -> bool:
    """A CUDA device computes the streamed experts (separate, or on unified memory): it packs
    them into slots through byte maps and reads misses at its own request."""
    return memory.device.startswith("cuda")


def _staged(stage: int, slots: int, disk_layers: int) -> int:
    """Experts one request at the GPU's request stages: at most a layer's share of the slots."""
    return min(stage, max(1, slots // max(disk_layers, 1)))


def _host_cache_slots(
    room: int, layers: list[int], host_free: int, slot_bytes: int, n_expert: int, n_used: int
) -> int:
    """Device slots for a cache over host-tier experts in `room` bytes (a layer's prompt copy
    kept where it fits), when every one of the `layers` (their experts' bytes) fits on host and
    each layer gets a token's experts; else 0 (a split by layer then)."""
    per = max(slot_bytes, 1)
    if sum(layers) > host_free or room < 0:
        return 0
    floor = n_used * len(layers)
    copy = n_expert * slot_bytes
    slots = (room - copy) // per if (room - copy) // per >= floor else room // per
    return int(min(slots, n_expert * len(layers))) if slots >= floor else 0


def _auto_split(
    config: ResidencyConfig, st: Streaming, memory: MemoryInfo, tiers: Mapping[str, str],
    sizes: Mapping[str, int],
) -> bool:  # fmt: skip
    """`host_compute = auto` where a separate CUDA device reads host-tier experts in place (the
    caller checks that) with no device slots over them: the CPU's share beside the bus's. On the
    H200 (tests/perf/results/offload.md, offload-host.md) the split decoded 1.3x mapped alone.
    The CPU reads the file's blocks beside the page-locked copy, so only in mmap mode with host
    RAM for both (or it would read the disk). Device slots (the user's, or auto's where the CPU
    cannot share: `_cpu_shares_layers`) stay mapped."""
    if config.host_compute != "auto" or config.load_mode != "mmap" or st.slots:
        return False
    if "disk" in tiers.values():
        return False
    hosted = [n for n, t in tiers.items() if t == "host" and expert_layer(n) is not None]
    return 2 * sum(sizes[n] for n in hosted) <= memory.host_free


def _cpu_shares_layers(config: ResidencyConfig, memory: MemoryInfo, hosted: int) -> bool:
    """Whether the CPU computes a share of the host-tier layers (split: asked for, or auto's
    where the file stays mapped and host RAM holds the page-locked copy beside it): then a split
    by layer beats the device's room as slots over every layer, whose misses make every layer
    wait on the CPU. On an H100 with 16 host cores (12 layers of the Qwen3-30B-A3B shape,
    tests/perf/results/offload.md, 2026-12-07 04:29): the layer split at 3,191 MiB decoded 1.33x
    / 2.03x / 0.90x auto's slots at 2,659 MiB under the synthetic router / uniform / zipf:1
    routing, and every expert on host with no slots (1,441 MiB) 1.20x / 1.43x / 0.97x the slots
    split at 1,989 MiB."""
    if config.host_compute == "split":
        return True
    auto = config.host_compute == "auto" and config.load_mode == "mmap"
    return auto and 2 * hosted <= memory.host_free


def expert_layer(name: str) -> int | None:
    """The layer of a routed-expert tensor (`blk.N.ffn_{gate,up,down}_exps.weight`), else None."""
    m = _EXPERT.match(name)
    return int(m.group(1)) if m else None


# a device slot pool packs a streamed expert by one gather per plane through int32 byte maps:
# four bytes of device memory per byte of one expert (`kernels.moe.slot_pool`)
PACKING_MAPS = 4
# experts read at the GPU's request are staged (page-locked) and cross into device scratch up to
# this many at a time, or a token's experts where more (`offload.file_experts`)
REQUEST_STAGE = 16


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    tiers: Mapping[str, str]  # tensor name -> device / host / disk
    sizes: Mapping[str, int]
    kv_bytes: int
    scratch_bytes: int  # compute scratch of one step (activations, dequantized experts)
    budget: int
    budget_source: str  # "given" or "measured free memory"
    memory: MemoryInfo
    load_mode: str
    streaming: Streaming  # slots resolved to a count when any expert is on disk
    slot_bytes: int  # one expert's gate+up+down bytes (the largest layer's)
    notes: tuple[str, ...]  # why tensors went where they did (what did not fit)
    warnings: tuple[str, ...]
    rules: tuple[str, ...]  # the rules as applied, for describe()
    host_compute: str = (
        "auto"  # host-tier experts: mapped, computed on the CPU, or copied (residency.py)
    )
    # mapped or disk-tier experts: one layer's copied to the device per prompt (0: no room)
    prompt_copy_bytes: int = 0
    # experts one request at the GPU's request stages (a token's experts at least)
    request_stage: int = REQUEST_STAGE
    runtime_bytes: int = 0  # the device runtime's own memory (a CUDA context), in a given budget
    split_share: float | None = None  # split: the CPU's share of a token's experts (None: default)
    state_bytes: int = 0  # hybrids' recurrent-state slots, beside the KV (engine.runtime)

    @property
    def computes_on_host(self) -> bool:
        """Host-tier experts run on the CPU while the rest runs on a separate device."""
        return self.host_compute == "host" and "host" in self.expert_tiers().values()

    def bytes_by_tier(self) -> dict[str, int]:
        out = dict.fromkeys(("device", "host", "disk"), 0)
        for name, tier in self.tiers.items():
            out[tier] += self.sizes[name]
        return out

    def expert_tiers(self) -> dict[int, str]:
        """Layer -> tier of its routed experts."""
        return {layer: self.tiers[n] for n in self.tiers if (layer := expert_layer(n)) is not None}

    @property
    def slot_pool_bytes(self) -> int:
        """Device (or host) slots: the disk tier's stream pool (with its packing maps on a
        separate device), or the mapped host tier's cache."""
        if not (self.streams or self.maps):
            return 0
        return (self.streaming.slots or 0) * self.slot_bytes + self.packing_maps_bytes

    @property
    def packing_maps_bytes(self) -> int:
        """The byte maps that pack streamed experts into a GPU's slot pool (`fill_mapped`), and
        the rows that reads at the GPU's request cross (device scratch; on unified memory the
        page-locked staging, in the same pool)."""
        if not (self.streams and _packs(self.memory)):
            return 0
        stage = _staged(self.request_stage, self.streaming.slots or 0, _disk_layers(self.tiers))
        return (PACKING_MAPS + stage) * self.slot_bytes

    @property
    def maps(self) -> bool:
        """Host-tier experts read in place by a separate device (`host_compute = mapped`)."""
        return (
            self.host_compute in ("mapped", "auto", "split")
            and self.memory.separate_device
            and "host" in self.expert_tiers().values()
        )

    @property
    def streams(self) -> bool:
        return "disk" in self.tiers.values()

    def describe(self) -> str:
        """The plan as text for people: bytes per tier, KV, slots, what did not fit and why."""
        by, mem = self.bytes_by_tier(), self.memory
        count = {t: sum(1 for v in self.tiers.values() if v == t) for t in by}
        where = mem.device if mem.separate_device else f"{mem.device} (device tier = host RAM)"
        if mem.unified:
            where = f"{mem.device} (unified memory: device and host are one pool)"
        lines = [
            f"residency plan on {where}",
            f"  budget   {fmt_bytes(self.budget)} ({self.budget_source})",
            f"  device   {fmt_bytes(by['device']):>11}  {count['device']} tensors",
            f"  host     {fmt_bytes(by['host']):>11}  {count['host']} tensors",
            f"  disk     {fmt_bytes(by['disk']):>11}  {count['disk']} tensors (read on demand)",
            f"  KV cache {fmt_bytes(self.kv_bytes):>11}  (estimate)",
            f"  scratch  {fmt_bytes(self.scratch_bytes):>11}  (activations, workspaces)",
        ]
        if self.state_bytes:  # a hybrid's per-sequence state, beside the KV
            lines.append(f"  states   {fmt_bytes(self.state_bytes):>11}  (recurrent state slots)")
        if self.runtime_bytes:
            lines.append(f"  runtime  {fmt_bytes(self.runtime_bytes):>11}  (the CUDA context)")
        if self.maps and not self.streams:
            lines.append(
                f"  expert slots {self.streaming.slots or 0} x {fmt_bytes(self.slot_bytes)} = "
                f"{fmt_bytes(self.slot_pool_bytes)} on the device: recently used host-tier "
                "experts (LRU)"
            )
        if self.streams:
            s = self.streaming
            maps = self.packing_maps_bytes
            lines.append(
                f"  expert slots {s.slots} x {fmt_bytes(self.slot_bytes)}"
                + (f" + {fmt_bytes(maps)} of packing maps and staging" if maps else "")
                + f" = {fmt_bytes(self.slot_pool_bytes)}, prefetch "
                f"{'on' if s.prefetch else 'off'}, evict {s.evict}"
                + (f", reads {s.reads}" if _packs(self.memory) else "")
            )
        if "host" in self.expert_tiers().values():
            lines.append(f"  host-tier experts: {_host_compute_text(self)}")
        if self.prompt_copy_bytes:
            lines.append(
                f"  prompt copy {fmt_bytes(self.prompt_copy_bytes)} on the device: one layer's "
                f"{'disk' if self.streams else 'host'}-tier experts at a time, for prompts"
            )
        lines.append(f"  load mode {self.load_mode}")
        used = by["device"] + self.kv_bytes + self.scratch_bytes + self.slot_pool_bytes
        used += self.runtime_bytes + self.state_bytes
        used += self.prompt_copy_bytes
        if not mem.separate_device:
            used += by["host"]
        lines.append(f"  planned use {fmt_bytes(used)} of {fmt_bytes(self.budget)}")
        lines += ["rules (first match wins):", *(f"  {r}" for r in self.rules or ("(none)",))]
        lines += ["placement:", *(f"  {n}" for n in self.notes)]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _host_compute_text(plan: ResidencyPlan) -> str:
    if not plan.memory.separate_device:
        return "computed where they are (host RAM is the compute device)"
    if plan.host_compute == "host":
        return "computed on the CPU (host_compute = host; only token rows cross)"
    if plan.host_compute == "split":
        share = "default" if plan.split_share is None else f"{plan.split_share:g}"
        return (
            "read in place by the device from page-locked host memory while the CPU computes a "
            "share of each decode token's experts from the file's blocks (host_compute = split, "
            f"split_share {share}; the blocks stay mapped from the file beside the page-locked "
            "copy)"
        )
    if plan.host_compute in ("mapped", "auto"):
        return (
            "read in place by the device from page-locked host memory (host_compute = "
            f"{plan.host_compute}; computed on the CPU where the device's kernels cannot)"
        )
    return "copied to the device per use (host_compute = device)"


def _unmatched_warnings(config: ResidencyConfig, names: list[str]) -> list[str]:
    out = []
    for rule in config.rules:
        if not any(rule.matches(n) for n in names):
            close = difflib.get_close_matches(rule.pattern, names, n=3, cutoff=0.3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            out.append(f"pattern {rule.pattern!r} ({rule.source}) matches no tensor{hint}")
    return out


def _ranges(layers: list[int]) -> str:
    spans, start = [], None
    for i, x in enumerate(layers):
        start = x if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            spans.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(spans)


def plan_residency(
    config: ResidencyConfig,
    sizes: Mapping[str, int],
    kv_bytes: int,
    memory: MemoryInfo,
    n_expert: int = 1,
    min_slots: int = 1,
    scratch_bytes: int = 0,
    host_cache: bool = False,
    runtime_bytes: int = 0,
    host_first: tuple[str, ...] = (),
    state_bytes: int = 0,
) -> ResidencyPlan:
    """Place every tensor. `n_expert` is the experts per layer (a slot holds one);
    `min_slots` the fewest slots worth streaming with (the engine passes the experts used
    per token), `scratch_bytes` the compute scratch a step needs (activations, dequantized
    experts), `runtime_bytes` what the device's runtime holds itself (a CUDA context: counted in
    a given budget), `host_cache`: the device reads host-tier experts in place and can cache them in
    slots (its kernels take the experts' types), `host_first`: tensors a separate device reads
    in place from host memory when not every expert is on it (by the rules, or for room: an
    untied embedding table, a row per token), `state_bytes`: a hybrid model's recurrent-state
    slots (held on the device like the KV). Raises ResidencyError, with the numbers, when the
    model cannot fit."""
    names = list(sizes)
    warnings = _unmatched_warnings(config, names)
    tiers: dict[str, str] = {}
    for name in names:
        rule = config.tier_of(name)
        if rule is not None:
            tiers[name] = rule.tier
    for n, t in tiers.items():
        # per-expert biases (gpt-oss) are tiny and the MoE block always holds them
        if t == "disk" and _EXPERT_BIAS.match(n):
            tiers[n] = "host"
    bad = [n for n, t in tiers.items() if t == "disk" and expert_layer(n) is None]
    if bad:
        raise ResidencyError(
            f"only routed-expert tensors (ffn_*_exps) can stay on disk, not {', '.join(bad[:4])}"
        )
    separate = memory.separate_device
    stuck = [n for n, t in tiers.items() if t == "host" and expert_layer(n) is None
             and not _EXPERT_BIAS.match(n) and n not in host_first]  # fmt: skip
    if separate and stuck:  # (the device would compute them from its own copy after all)
        also = f" and {', '.join(host_first)}" if host_first else ""
        raise ResidencyError(
            f"only routed experts{also} can be on host beside a separate device, not "
            f"{', '.join(stuck[:4])}: their layers compute on the device; place them there"
        )
    budget = config.budget or (memory.device_free if separate else memory.host_free)
    source = "given" if config.budget else "measured free memory"
    overhead = kv_bytes + scratch_bytes + runtime_bytes + state_bytes
    held = sum(sizes[n] for n in names if tiers.get(n, "device") == "device")
    ruled_off = any(t != "device" for n, t in tiers.items() if expert_layer(n) is not None)
    if separate and (ruled_off or held + overhead > budget):
        first = [n for n in host_first if n in sizes and n not in tiers]
        tiers.update(dict.fromkeys(first, "host"))
    else:
        first = []
    for n in names:
        if expert_layer(n) is None:
            tiers.setdefault(n, "device")
    # the pool the budget covers: the device's, which on CPU/unified also holds host tensors
    pool_tiers = ("device",) if separate else ("device", "host")
    fixed = sum(sizes[n] for n, t in tiers.items() if t in pool_tiers and expert_layer(n) is None)
    runtime = f" and the CUDA context {fmt_bytes(runtime_bytes)}" if runtime_bytes else ""
    if state_bytes:
        runtime = f" and the recurrent state {fmt_bytes(state_bytes)} (--parallel){runtime}"
    if fixed + overhead > budget:
        raise ResidencyError(
            f"budget {fmt_bytes(budget)} ({source}) is too small: the non-expert weights need "
            f"{fmt_bytes(fixed)}, the KV cache {fmt_bytes(kv_bytes)}, compute scratch "
            f"{fmt_bytes(scratch_bytes)}{runtime}; raise --mem-budget, "
            "shorten the context (-c) or pick a smaller quantization"
        )
    experts: dict[int, list[str]] = {}
    for n in names:
        if (layer := expert_layer(n)) is not None:
            experts.setdefault(layer, []).append(n)
    notes = [
        f"non-expert weights {fmt_bytes(fixed)} + KV {fmt_bytes(kv_bytes)} + scratch "
        f"{fmt_bytes(scratch_bytes)}{runtime.replace(' and', ' +')} on the device"
    ]
    used = fixed + overhead
    used += sum(
        sizes[n] for n, t in tiers.items() if t in pool_tiers and expert_layer(n) is not None
    )
    if used > budget:
        raise ResidencyError(
            f"the tensors the rules pin to memory need {fmt_bytes(used)}, over the budget of "
            f"{fmt_bytes(budget)} ({source}); put experts on host or disk"
        )
    slot_bytes = max((sum(sizes[n] for n in ns) // n_expert for ns in experts.values()), default=0)
    pinned = sorted(layer for layer, ns in experts.items() if any(n in tiers for n in ns))
    if first:
        notes.append(f"{', '.join(first)} on host, read in place by the device (not every expert "
                     "is on it)")  # fmt: skip
    if pinned:
        notes.append(f"experts of layers {_ranges(pinned)} placed by rules")
    auto = sorted(layer for layer, ns in experts.items() if not any(n in tiers for n in ns))
    st = config.streaming
    reserve = (st.slots or min_slots) * slot_bytes if st.enabled else 0
    host_left = memory.host_free if separate else 0
    moved: dict[str, list[int]] = {"device": [], "host": [], "disk": []}
    before = used  # (what the auto-placed experts find taken)
    for layer in auto:
        need = sum(sizes[n] for n in experts[layer])
        if used + need + reserve <= budget:
            tier, used = "device", used + need
        elif separate and need <= host_left:
            tier, host_left = "host", host_left - need
        elif st.enabled:
            tier = "disk"
        else:
            raise ResidencyError(
                f"the experts of layer {layer} ({fmt_bytes(need)}) do not fit in the "
                f"{fmt_bytes(budget - used)} left and expert streaming is disabled"
            )
        moved[tier].append(layer)
        tiers.update(dict.fromkeys(experts[layer], tier))
    cache = host_cache and config.host_compute in ("mapped", "auto", "split") and not st.slots
    if (
        cache
        and moved["host"]
        and not moved["disk"]
        and not _cpu_shares_layers(
            config, memory, sum(sizes[n] for la in moved["host"] for n in experts[la])
        )
    ):
        # (layers a rule put on host share the slots too)
        hosted = [la for la, ns in experts.items() if la in auto or tiers[ns[0]] == "host"]
        slots = _host_cache_slots(budget - before, [sum(sizes[n] for n in experts[la])
                                  for la in hosted], memory.host_free, slot_bytes, n_expert,
                                  min_slots)  # fmt: skip
        if slots:  # every auto-placed layer on host, the device's room as their LRU slots
            for layer in moved["device"]:
                tiers.update(dict.fromkeys(experts[layer], "host"))
                used -= sum(sizes[n] for n in experts[layer])
            moved = {"device": [], "host": auto, "disk": []}
            st = replace(st, slots=slots)
            notes.append(
                "every layer's experts on host, the device's room as slots over them "
                "(more of a token's experts on the device than a split by layer)"
            )
    for tier, layers in moved.items():
        if layers:
            notes.append(f"experts of layers {_ranges(layers)} auto-placed on {tier}")
    if moved["host"] or moved["disk"]:
        notes.append(
            f"the rest did not fit: {fmt_bytes(budget - used)} left of {fmt_bytes(budget)} "
            f"after the weights above and {fmt_bytes(reserve)} kept for expert slots"
        )
    for layer, ns in experts.items():
        if len({tiers[n] for n in ns}) > 1:
            raise ResidencyError(f"layer {layer}: gate/up/down experts must share one tier")
    streaming, disk_copy = st, 0
    if "disk" in tiers.values():
        if not st.enabled:
            raise ResidencyError("experts are on disk but [streaming] enabled = false")
        # a device slot pool's maps, and the scratch that misses cross into (as many experts as
        # one request stages); prompts copy the experts of the layer they use to the device (raw
        # and packed: twice a layer's bytes) where the budget has room
        gpu = _packs(memory)  # (a separate GPU, or one on unified memory)
        maps = PACKING_MAPS * slot_bytes if gpu else 0
        layer_copy = 2 * n_expert * slot_bytes if gpu else 0
        per, stage = max(slot_bytes, 1), max(REQUEST_STAGE, min_slots) if gpu else 0
        disk = _disk_layers(tiers)
        if st.slots:
            slots = st.slots
        else:
            room = budget - used - maps
            # reads at the GPU's request keep a token's experts in each layer's own slots
            floor = min_slots * (disk if gpu and st.reads != "host" else 1)
            room = room - layer_copy if room - layer_copy >= (floor + stage) * per else room
            slots = max(floor, room // per - stage)
        maps += _staged(stage, slots, disk) * slot_bytes
        if used + slots * slot_bytes + maps > budget:
            raise ResidencyError(
                f"{slots} expert slots of {fmt_bytes(slot_bytes)} do not fit in the "
                f"{fmt_bytes(budget - used)} the budget leaves"
            )
        if gpu and used + slots * slot_bytes + maps + layer_copy <= budget:
            disk_copy = layer_copy
        elif gpu:
            notes.append("prompts read the disk-tier experts through the slots, a few rows at a "
                         "time (no room for a layer's copy)")  # fmt: skip
        # read-ahead off unless asked: measured slower on a CPU-only run and on the H200, where it
        # competes with the decode chain's host steps (tests/perf/results/offload-disk.md)
        prefetch = bool(st.prefetch)
        streaming = replace(st, enabled=True, slots=int(slots), prefetch=prefetch)
        notes.append(f"{slots} slots stream the disk-tier experts ({fmt_bytes(slot_bytes)} each)")
    maps = config.host_compute in ("mapped", "auto", "split")
    mapped = maps and separate and "host" in tiers.values()
    if mapped and st.slots and "disk" not in tiers.values():
        if used + st.slots * slot_bytes > budget:
            raise ResidencyError(
                f"{st.slots} expert slots of {fmt_bytes(slot_bytes)} do not fit in the "
                f"{fmt_bytes(budget - used)} the budget leaves"
            )
        notes.append(f"{st.slots} device slots cache recently used host-tier experts (LRU)")
    copy = 0
    if mapped and "disk" not in tiers.values():
        # a prompt copies a layer's mapped experts to the device in one DMA per plane (each
        # byte crosses the bus once, at copy speed) where the budget has room for one layer
        layer = n_expert * slot_bytes
        if used + (st.slots or 0) * slot_bytes + layer <= budget:
            copy = layer
        else:
            notes.append("prompts read the host-tier experts in place (no room for a layer's copy)")
    copy = copy or disk_copy
    host_compute = config.host_compute
    if host_cache and mapped and _auto_split(config, st, memory, tiers, sizes):
        host_compute = "split"
        notes.append(
            "the CPU computes a share of each decode token's host-tier experts while the "
            "device reads the rest over the bus (split)"
        )
    rules = tuple(f"{r.pattern} -> {r.tier}  ({r.source})" for r in config.rules)
    return ResidencyPlan(
        tiers, dict(sizes), kv_bytes, scratch_bytes, budget, source, memory, config.load_mode,
        streaming, slot_bytes, tuple(notes), tuple(warnings), rules, host_compute, copy,
        max(REQUEST_STAGE, min_slots), runtime_bytes, config.split_share, state_bytes,
    )  # fmt: skip
