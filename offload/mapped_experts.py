"""One MoE layer's routed experts in mapped host memory (`offload.mapped`), read in place by the
GPU's grouped GEMV kernels, with an optional device cache of the layer's hottest experts.

Every expert keeps its full copy in host memory; a cached one also has a copy in a device slot,
and an address table ([E, fields] int64 per weight, `repack.PackedBlocks.table`) tells the kernels
where each expert's planes are read. Routing counts accumulate on the device inside the decode
graph (no host sync); every `every` steps `tick` re-ranks the experts by their decayed counts and
copies the newcomers into the slots of the coldest ones (DMA from the page-locked copy, on the
compute stream, so replays before and after see consistent slots and tables). The bytes are
the same wherever they are read from, so the output does not depend on what is cached.
"""

import dataclasses

import torch

from localllm.offload.mapped import host_view, map_packed_experts

REBALANCE_EVERY = 8  # decode steps between re-rankings (each costs one small device-to-host copy)
DECAY = 0.5  # counts kept per re-ranking: recent routing weighs more than old


class MappedExperts:
    """`packed` is what the kernels take (`kernels.moe.packed.PackedExperts` whose weights carry
    address tables when `slots` > 0); `count(ids)` records routing, `tick()` maintains the cache."""

    def __init__(self, pe, slots: int, every: int = REBALANCE_EVERY, mapper=map_packed_experts):
        """`pe`: the layer's packed experts (on the GPU, used once to fill the host copy);
        `mapper` makes the host copy (tests on CPU pass one that keeps plain tensors)."""
        host = mapper(pe)
        self.host = host
        self.n_expert = host.n_expert
        self.slots = max(0, min(slots, self.n_expert))
        self.every, self.steps, self.moved = every, 0, 0
        dev = pe.counters[0].device
        self.counts = torch.zeros(self.n_expert, dtype=torch.float32, device=dev)
        self.slot_expert = [-1] * self.slots  # which expert each slot holds
        self._last = torch.zeros(self.n_expert)  # counts after the last re-ranking's decay
        self.stats = None  # an `ExpertStats` to account routing into, or None
        if not self.slots:
            self.packed = host
            return
        weights = (*host.gate_up, host.down)
        self._pool = [
            {f: torch.empty(self.slots, *p.shape[1:], dtype=p.dtype, device=dev)
             for f, p in w.planes.items()}
            for w in weights
        ]  # fmt: skip
        # each weight's address table, kept on the host too (the device copy is rewritten whole)
        self._tab_host = [self._host_addresses(w.planes) for w in weights]
        self._tabs = [t.to(dev) for t in self._tab_host]
        tabbed = [dataclasses.replace(w, table=t) for w, t in zip(weights, self._tabs, strict=True)]
        self.packed = dataclasses.replace(host, gate_up=tuple(tabbed[:-1]), down=tabbed[-1])

    @property
    def nbytes_device(self) -> int:
        """Bytes of the device slots."""
        pools = getattr(self, "_pool", ())
        return sum(t.numel() * t.element_size() for w in pools for t in w.values())

    def _host_addresses(self, planes: dict[str, torch.Tensor]) -> torch.Tensor:
        e = torch.arange(self.n_expert, dtype=torch.int64)
        cols = [p.data_ptr() + e * p.stride(0) * p.element_size() for p in planes.values()]
        return torch.stack(cols, dim=1)

    def count(self, ids: torch.Tensor) -> None:
        """Record a step's routing (device ids, any shape); captured into graphs as one kernel."""
        flat = ids.reshape(-1)
        self.counts.index_add_(0, flat, torch.ones(flat.numel(), device=flat.device))

    def tick(self) -> None:
        """One step done: every `every` steps, account the routing and refill the slots."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.rebalance()

    def rebalance(self) -> int:
        """Account the routing since the last call (`stats`: lookups, hits = pairs whose expert
        was in a slot, misses = read over the bus); cache the hottest experts, newcomers taking
        the slots of the coldest (ties keep what is cached). Returns how many moved in."""
        counts = self.counts.to("cpu", copy=True)  # (a CPU tensor's .cpu() is itself)
        self.counts.mul_(DECAY)
        new, self._last = counts - self._last, counts * DECAY
        if self.stats is not None:
            routed = round(float(new.sum()))
            hits = round(float(new[[e for e in self.slot_expert if e >= 0]].sum()))
            self.stats.lookups += routed
            self.stats.hits += hits
            self.stats.misses += routed - hits
        if not self.slots:
            return 0
        cached = torch.zeros(self.n_expert)
        held = [e for e in self.slot_expert if e >= 0]
        cached[held] = 1.0
        score = counts + 1e-3 * cached  # a cached expert wins a tie: no churn on equal counts
        want = {e for e in score.topk(self.slots).indices.tolist() if counts[e] > 0}
        enter = sorted((e for e in want if e not in held), key=lambda e: -float(counts[e]))
        free = [s for s, e in enumerate(self.slot_expert) if e < 0 or e not in want]
        heat = [float(counts[e]) if e >= 0 else -1.0 for e in self.slot_expert]
        free.sort(key=heat.__getitem__)  # empty slots first, then the coldest
        for e, s in zip(enter, free, strict=False):
            self._fill(s, e)
        if enter:
            for tab, t in zip(self._tabs, self._tab_host, strict=True):
                tab.copy_(t)
        self.moved += len(enter)
        return len(enter)

    def _fill(self, slot: int, expert: int) -> None:
        old = self.slot_expert[slot]
        weights = (*self.host.gate_up, self.host.down)
        for w, pool, tab in zip(weights, self._pool, self._tab_host, strict=True):
            for j, (f, plane) in enumerate(w.planes.items()):
                pool[f][slot].copy_(host_view(plane)[expert], non_blocking=True)
                tab[expert, j] = pool[f][slot].data_ptr()
                if old >= 0:
                    tab[old, j] = plane.data_ptr() + old * plane.stride(0) * plane.element_size()
        self.slot_expert[slot] = expert
