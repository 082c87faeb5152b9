"""The disk tier on a GPU without the host in the decode step: each MoE layer keeps a device-side
LRU of expert slots (`kernels.moe.slot_lru`, as mapped host experts do), and its misses are read
from the GGUF at the GPU's own request (`kernels.moe.slot_requests` + `offload.expert_reads`): the
decode step stays one CUDA graph, a step whose experts all sit in slots never involves the host,
and a miss costs one round trip to the reader thread, its preads, a copy over the bus and a
gather into the slot's planes. Prompts read the experts they use once per layer on the calling
thread, pack them on the device and run the resident grouped kernels over them (where the plan
made room; else they go through the slots a few rows at a time). Outputs are the resident
kernels' bits for the same launch wherever the bytes came from (a step with more pairs than a
request carries is launched per group of rows: the bits of those smaller launches).

`FileSlots` is what a model's streamed layers share (reader, device scratch, byte maps, the
request counter; it is their `ExpertSource` for counters); `FileExperts` is one layer. On unified
memory the staging rows are packed in place (no device scratch, one copy fewer).
"""

import time

import torch

from localllm.kernels.moe import ExpertFormat
from localllm.offload.expert_reads import ExpertReader
from localllm.offload.expert_source import ExpertLayout, IgnoresHints
from localllm.offload.expert_stats import ExpertStats

ACCOUNT_EVERY = 8  # steps between reads of the device counters (each one small copy to the host)
PROMPT_WAVE = 8  # experts a prompt reads into page-locked buffers before copying them over


class FileSlots(IgnoresHints):
    """The streamed layers' shared parts on `device`; `cap` staging rows (the most misses one
    request carries). `mapper`: see `ExpertReader` (tests on CPU keep plain tensors)."""

    together = None

    def __init__(self, layouts: dict[int, ExpertLayout], cap: int, device, lib, mapper=None,
                 threads: int | None = None, prompt_copy: bool = True,
                 in_place: bool = False):  # fmt: skip
        self.prompt_copy = prompt_copy  # the plan made room for a prompt's layer on the device
        self.reader = ExpertReader(layouts, cap, lib, mapper, threads)
        self.device = torch.device(device)
        # unified memory (`in_place`): misses are packed straight from the staging rows, which
        # are the device's memory too; a separate device first copies them over the bus
        self.in_place = in_place
        self.scratch = self.reader.staging if in_place else torch.empty(
            cap, self.reader.stride, dtype=torch.uint8, device=device)  # fmt: skip
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)
        # the read-ahead in flight (its request number, 0: none) and experts read ahead so far
        self.ahead = torch.zeros(2, dtype=torch.int64, device=device)
        self._ahead_seen = 0
        self.stats = ExpertStats()
        self._maps: dict[ExpertFormat, list[torch.Tensor]] = {}
        self._read = (0, 0.0)  # reader counters already in `stats`
        self.layers: list[FileExperts] = []  # reset together when a read fails
        pin = self.device.type == "cuda"
        most = [max(lay.shapes[p][0] * lay.shapes[p][1] for lay in layouts.values())
                for p in range(3)]  # fmt: skip
        self._waves = []
        for _ in range(2):  # a prompt reads one wave while the last one crosses the bus
            bufs = tuple(torch.empty(PROMPT_WAVE * n, dtype=torch.uint8, pin_memory=pin)
                         for n in most)  # fmt: skip
            self._waves.append([bufs, None])
        self.reader.start()

    def check(self) -> None:
        """Raise the error a request met since the last check; every layer's slots are emptied
        first (a failed request left some holding bytes that are not their expert's)."""
        try:
            self.reader.check()
        except Exception:
            for layer in self.layers:
                layer.forget()
            raise

    def pool(self, fmt: ExpertFormat, slots: int, n_used: int):
        """A device slot pool of `fmt` (`kernels.moe.slot_pool`) whose byte maps are found once
        per format and shared by its layers."""
        from localllm.kernels.moe.slot_pool import PackedSlotPool

        pool = PackedSlotPool(fmt, slots, n_used, self.device, maps=self._maps.get(fmt))
        self._maps.setdefault(fmt, pool.byte_maps())
        return pool

    def read_experts(self, layer: int, experts: list[int]) -> tuple[torch.Tensor, ...]:
        """Raw (gate, up, down) [n_expert, rows, row bytes] of `layer` on the device with
        `experts` read in at their own index (the others left unwritten): read PROMPT_WAVE at a
        time into page-locked buffers, each wave's copy overlapping the next wave's reads."""
        lay = self.reader.layouts[layer]
        n, t0 = len(experts), time.perf_counter()
        out = tuple(torch.empty((lay.n_expert, r, b), dtype=torch.uint8, device=self.device)
                    for r, b in lay.shapes)  # fmt: skip
        for i, w in enumerate(range(0, n, PROMPT_WAVE)):
            wave = self._waves[i % 2]
            if wave[1] is not None:
                wave[1].synchronize()  # its last copy has left the buffers
            part = experts[w : w + PROMPT_WAVE]
            bufs = tuple(b[: PROMPT_WAVE * r * c].view(PROMPT_WAVE, r * c)
                         for b, (r, c) in zip(wave[0], lay.shapes, strict=True))  # fmt: skip
            self.reader.read_parts(layer, part, bufs)
            at = torch.tensor(part, device=self.device)
            for o, b in zip(out, bufs, strict=True):
                moved = b[: len(part)].to(self.device, non_blocking=True)
                o.view(lay.n_expert, -1).index_copy_(0, at, moved)
            if self.device.type == "cuda":
                wave[1] = torch.cuda.Event()
                wave[1].record()
        seconds = time.perf_counter() - t0
        self.stats.bytes_read += n * lay.expert_nbytes
        self.stats.read_seconds += seconds
        self.stats.stall_seconds += seconds
        return out

    def account(self) -> None:
        """The reader's counters since the last call into `stats` (the GPU waited for them)."""
        _, _, nbytes, seconds = self.reader.stats()
        ahead = int(self.ahead[1])
        self.stats.prefetched += ahead - self._ahead_seen
        self._ahead_seen = ahead
        b0, s0 = self._read
        self._read = (nbytes, seconds)
        self.stats.bytes_read += nbytes - b0
        self.stats.read_seconds += seconds - s0
        self.stats.stall_seconds += seconds - s0

    def fetch(self, layer: int, expert: int):
        raise ValueError("experts streamed at the GPU's request are not fetched one by one")

    def close(self) -> None:
        self.reader.close()


class FileExperts:
    """One layer's `slots` device slots of format `fmt`, filled from the file on request;
    `ffn(...)`, `replayed(tokens)` and `account()` as `offload.mapped_experts.MappedExperts`."""

    def __init__(self, layer: int, layout: ExpertLayout, fmt: ExpertFormat, slots: int,
                 n_used: int, shared: FileSlots):  # fmt: skip
        from localllm.kernels.moe.slot_lru import LruState
        from localllm.kernels.moe.slot_requests import pack_descriptors

        if slots < n_used:
            raise ValueError(f"{slots} slots cannot hold one token's {n_used} experts")
        self.layer, self.n_expert, self.n_used = layer, layout.n_expert, n_used
        self.shared, self.slots, self.stats = shared, slots, shared.stats
        dev = shared.device
        self.pool = shared.pool(fmt, slots, n_used)
        shared.layers.append(self)
        self._desc = pack_descriptors(self.pool.plane_bytes, self.pool.byte_maps())
        self._max_bytes = max(p.shape[1] for p in self.pool.plane_bytes)
        self.host = self.pool.pe  # what the block's kernels are given (`packed`)
        self.lru = LruState.empty(self.n_expert, slots, dev)
        self._jobs = torch.zeros(self.n_expert * 2, dtype=torch.int32, device=dev)
        self._njobs = torch.zeros(1, dtype=torch.int32, device=dev)
        # read ahead into this layer's slots by the layer before (`read_ahead`), packed by
        # `_settle` when this layer runs; `ahead`: the next layer, when reads ahead are on
        self._ahead_jobs = torch.zeros(self.n_expert * 2, dtype=torch.int32, device=dev)
        self._ahead_n = torch.zeros(1, dtype=torch.int32, device=dev)
        self.ahead: FileExperts | None = None
        self.rows = min(slots // n_used, shared.reader.cap // n_used)  # token rows per request
        self.steps, self._seen, self._ahead_most = 0, (0, 0), 0
        self._expert_nbytes = layout.expert_nbytes

    def ffn(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, fmt, xq=None,
            guess: torch.Tensor | None = None):  # fmt: skip
        """The routed experts of x [T, dim] -> float32 [T, dim] (the resident packed math).
        `guess`: the next layer's routing of x (its router's ids [T, k]); with `ahead` set, a
        decode step reads that layer's missing guesses while this one computes."""
        from localllm.kernels.moe.packed import PACKED_MAX_T

        self.shared.check()
        self._settle()
        t = ids.shape[0]
        if t > PACKED_MAX_T and self.shared.prompt_copy:
            y = self._prompt(x, weights, ids, fmt, xq)
        elif t <= self.rows:
            y = self._cached(x, weights, ids, fmt, xq, guess)
        else:  # fewer slots than the pairs (or no room for a prompt's copy): groups of rows
            r = self.rows
            y = torch.cat([self._cached(x[i : i + r], weights[i : i + r], ids[i : i + r], fmt)
                           for i in range(0, t, r)])  # fmt: skip
        if not _capturing(x):
            self._step()
        return y

    def _cached(self, x, weights, ids, fmt, xq=None, guess=None):
        from localllm.kernels.moe.packed import expert_ffn_packed
        from localllm.kernels.moe.slot_lru import assign
        from localllm.kernels.moe.slot_requests import request

        sh = self.shared
        slots = assign(ids, self.lru, self._jobs, self._njobs)
        request(self._njobs, self._jobs, sh.reader.box, sh.seq, self.layer, ids.numel())
        self._fill(self._njobs, self._jobs, ids.numel())
        if guess is not None and self.ahead is not None:
            self.ahead.read_ahead(guess)
        return expert_ffn_packed(x, weights, slots, self.pool.pe, fmt, xq)

    def _fill(self, njobs: torch.Tensor, jobs: torch.Tensor, most: int) -> None:
        """The staged experts of `jobs` over the bus and packed into their slots."""
        from localllm.kernels.moe.slot_requests import copy_staged, pack_staged

        sh = self.shared
        if not sh.in_place:
            copy_staged(njobs, sh.reader.staging, sh.scratch, most, self._expert_nbytes)
        pack_staged(njobs, jobs, sh.scratch, self._desc, most, self._max_bytes, sh.in_place)

    def read_ahead(self, guess: torch.Tensor) -> None:
        """Slots for this layer's guessed experts (ids, at most a request's worth), their reads
        posted without waiting (the layer before computes meanwhile); `_settle` packs them."""
        from localllm.kernels.moe.slot_lru import assign
        from localllm.kernels.moe.slot_requests import request

        sh, n = self.shared, guess.numel()
        if n > sh.reader.cap or n > self.slots:
            return
        assign(guess, self.lru, self._ahead_jobs, self._ahead_n, count=False)
        request(self._ahead_n, self._ahead_jobs, sh.reader.box, sh.seq, self.layer, n,
                ahead=sh.ahead)  # fmt: skip
        self._ahead_most = n

    def _settle(self) -> None:
        """The read-ahead posted for this layer (if any) answered, and packed into its slots
        before anything else uses the mailbox, the staging rows or these slots."""
        from localllm.kernels.moe.slot_requests import settle

        if self._ahead_most:
            sh, most = self.shared, self._ahead_most
            settle(sh.reader.box, sh.ahead, sh.seq, self._ahead_jobs, self._ahead_n, self.lru, most)
            self._fill(self._ahead_n, self._ahead_jobs, most)
            self._ahead_n.zero_()

    def _prompt(self, x, weights, ids, fmt, xq):
        """Every expert the prompt routes to, read once and packed on the device as a whole
        layer (rows of experts it does not use are left unwritten and never read): the resident
        grouped GEMMs on the resident shapes. The slots keep what decode cached."""
        from localllm.kernels.moe.packed import expert_ffn_packed, pack_experts

        if _capturing(x):
            raise RuntimeError("a prompt over experts read from the file cannot be captured")
        g, u, d = self.shared.read_experts(self.layer, torch.unique(ids).tolist())
        pe = pack_experts(g, u, d, fmt, self.n_used)
        del g, u, d
        self.stats.lookups += ids.numel()
        self.stats.misses += ids.numel()
        return expert_ffn_packed(x, weights, ids, pe, fmt, xq)

    def replayed(self, tokens: int) -> None:
        """A decode-graph replay ran this layer (no Python ran in it)."""
        self.shared.check()
        self._step()

    def forget(self) -> None:
        """Every slot empty (their bytes are no longer trusted)."""
        self.lru.slot_of.fill_(-1)
        self.lru.expert_of.fill_(-1)
        self.lru.stamp.fill_(-1)
        self._ahead_n.zero_()
        self.shared.ahead[:1].zero_()  # (a kernel: this may run while a graph is captured)

    def _step(self) -> None:
        self.steps += 1
        if self.steps % ACCOUNT_EVERY == 0:
            self.account()

    def account(self) -> None:
        """Lookups and misses since the last call into `stats` (misses: pairs whose expert was
        read from the file), and the reader's counters."""
        _, seen, missed = self.lru.counters.tolist()
        lookups, misses = seen - self._seen[0], missed - self._seen[1]
        self._seen = (seen, missed)
        self.stats.lookups += lookups
        self.stats.misses += misses
        self.stats.hits += lookups - misses
        self.shared.account()


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()
