"""One MoE layer's routed experts in mapped host memory (`offload.mapped`), read by the GPU's
grouped GEMV kernels, with an optional device cache of recently used experts.

Without slots every pair's expert is read in place over the bus. With slots, a device-side LRU
(`kernels.moe.slot_lru`) gives each pair a slot: a missing expert is first copied from the
page-locked host copy into the least recently used slot by a GPU kernel (every SM pulling over
the bus at once, where one expert's GEMV alone would keep few reads in flight), then the GEMVs
read the slots. No decision reaches the host, so the decode step stays one CUDA graph. A prompt
copies the whole layer to the device first where the plan made room (`prompt_copy`). The bytes
are the same wherever they are read from, so the output does not depend on what is cached.
"""

import dataclasses

import torch

from localllm.kernels.quant.repack import PackedBlocks
from localllm.offload.mapped import host_view, map_packed_experts

ACCOUNT_EVERY = 8  # steps between reads of the device counters (each one small copy to the host)


class MappedExperts:
    """`ffn(...)` computes the layer's routed experts; `replayed(tokens)` counts a decode-graph
    replay (which runs no Python); `account()` moves the counts into `stats`."""

    def __init__(
        self, pe, slots: int, n_used: int, mapper=map_packed_experts, prompt_copy: bool = False
    ) -> None:
        """`pe`: the layer's packed experts (on the GPU, used once to fill the host copy);
        `mapper` makes the host copy (tests on CPU pass one that keeps plain tensors);
        `prompt_copy`: a prompt first copies the layer to the device (the plan made room)."""
        self.host = mapper(pe)
        self.prompt_copy = prompt_copy
        self.n_expert, self.n_used = self.host.n_expert, n_used
        self.slots = max(0, min(slots, self.n_expert))
        self.stats = None  # an `ExpertStats` to account routing into, or None
        self.steps, self._pending, self._seen = 0, 0, (0, 0)
        self.lru = None
        if not self.slots:
            return
        from localllm.kernels.moe.slot_lru import LruState, copy_descriptors
        from localllm.kernels.moe.slot_pool import empty_slots

        dev = pe.counters[0].device
        gate_up = tuple(empty_slots(p, self.slots) for p in self.host.gate_up)
        down = empty_slots(self.host.down, self.slots)
        self.pool = type(self.host)(gate_up, down, self.host.counters)
        self.lru = LruState.empty(self.n_expert, self.slots, dev)
        srcs, dsts = (*self.host.gate_up, self.host.down), (*gate_up, self.pool.down)
        pairs = [
            (t, d.planes[f]) for s, d in zip(srcs, dsts, strict=True) for f, t in s.planes.items()
        ]
        self._desc = copy_descriptors(pairs, dev)
        self._max_words = int(self._desc[:, 4].max())
        self._jobs = torch.zeros(self.n_expert * 2, dtype=torch.int32, device=dev)
        self._njobs = torch.zeros(1, dtype=torch.int32, device=dev)

    def ffn(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, fmt, xq=None):
        """The routed experts of x [T, dim] -> float32 [T, dim] (the resident packed math)."""
        from localllm.kernels.moe.packed import PACKED_MAX_T, expert_ffn_packed

        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        cached = self.lru is not None and ids.shape[0] <= PACKED_MAX_T
        if cached and ids.numel() <= self.slots:
            from localllm.kernels.moe.slot_lru import assign, copy_jobs

            slots = assign(ids, self.lru, self._jobs, self._njobs)
            copy_jobs(self._jobs, self._njobs, self._desc, ids.numel(), self._max_words)
            y = expert_ffn_packed(x, weights, slots, self.pool, fmt, xq)
        else:  # no slots, a prompt (every expert streams once), or more pairs than slots
            src = self.host
            if self.prompt_copy and not capturing and self._prompt(ids):
                src = self._copied(x.device)
            y = expert_ffn_packed(x, weights, ids, src, fmt, xq)
            if not capturing:
                self._pending += ids.numel()
        if not capturing:
            self._step()
        return y

    def _prompt(self, ids: torch.Tensor) -> bool:
        """A prompt routing at least as many pairs as the layer has experts: most experts are
        used, and the grouped GEMMs would read each one's bytes over the bus once per 64-row
        block of its pairs; one DMA per plane brings them across once, at copy speed."""
        from localllm.kernels.moe.packed import PACKED_MAX_T

        return ids.shape[0] > PACKED_MAX_T and ids.numel() >= self.n_expert

    def _copied(self, device: torch.device):
        """The layer's experts copied from the page-locked host copy to `device` (same bytes,
        same kernels: the same bits); freed when the prompt's layer is done with them."""

        def one(p: PackedBlocks) -> PackedBlocks:
            planes = {}
            for name, t in p.planes.items():
                planes[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
                planes[name].copy_(host_view(t), non_blocking=True)
            return PackedBlocks(p.qtype, p.n, p.k, planes)

        gate_up = tuple(one(p) for p in self.host.gate_up)
        return dataclasses.replace(self.host, gate_up=gate_up, down=one(self.host.down))

    def replayed(self, tokens: int) -> None:
        """A decode-graph replay of `tokens` rows ran this layer (no Python ran in it)."""
        if self.lru is None:
            self._pending += tokens * self.n_used
        self._step()

    def _step(self) -> None:
        self.steps += 1
        if self.steps % ACCOUNT_EVERY == 0:
            self.account()

    def account(self) -> None:
        """Add the lookups since the last call to `stats`: hits are pairs served by a slot that
        already held their expert, misses pairs whose expert came over the bus."""
        lookups = misses = self._pending
        self._pending = 0
        if self.lru is not None:
            _, seen, missed = self.lru.counters.tolist()
            lookups += seen - self._seen[0]
            misses += missed - self._seen[1]
            self._seen = (seen, missed)
        if self.stats is not None:
            self.stats.lookups += lookups
            self.stats.misses += misses
            self.stats.hits += lookups - misses
