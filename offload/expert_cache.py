"""The disk tier's expert source: `StreamedExperts` preads an expert's three contiguous slices
from the GGUF into one of a fixed number of slots on a miss, evicting by recency (LRU) or
frequency (LFU), and optionally reads ahead, on a background thread, the experts a coming
layer's router guesses from the current hidden state. Disk-tier experts are never kept beyond
their slots.
"""

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from localllm.kernels.moe import ExpertBlocks
from localllm.kernels.moe.prepared import PreparedExpert, prepare_expert, prepared_format_nbytes
from localllm.offload.expert_source import ExpertLayout
from localllm.offload.expert_stats import ExpertStats
from localllm.offload.reader import pread_all, shares
from localllm.offload.staging import StagingRing

log = logging.getLogger(__name__)

# A layer's missing experts are read by up to READ_THREADS threads, each one contiguous share of
# their bytes (`reader.shares`): a page-cache copy runs ~5 GB/s per thread (H200 host), and a
# decode step waits for every miss.
READ_THREADS = 8
# Packed on a device: misses staged in a ring of page-locked buffers (at most this many bytes),
# read and uploaded this many at a time.
STAGE_BYTES = 256 << 20
STAGE_WAVE = 8


LFU_WINDOW = 32  # lfu: the victim is the least used of this many least recently used slots


class StreamedExperts:
    """Disk-tier experts read on demand into `slots` fixed buffers, evicting the least recently
    used one (`evict="lru"`) or the least used of the LFU_WINDOW least recent (`"lfu"`).

    The pool is allocated once (slots x the largest expert), so memory stays bounded whatever
    the routing does; blocks handed out by `fetch` stay valid until the next `fetch`. With
    `prepare` (experts computed on the CPU; every layout needs its `fmt`), a slot's expert is
    prepared right after it is read, in the reading thread, and `fetch` answers with that
    PreparedExpert until the slot is reused: at most slots x (raw + prepared) bytes. With
    `pack_on` (a CUDA device; all layouts of one format), the slots are a `PackedSlotPool` there:
    a read is staged in a ring of page-locked host buffers (`StagingRing`), uploaded without
    waiting and packed into its slot by one gather per plane, hits never cross the bus again, and
    `slots_for` gives the slot numbers the grouped GEMVs read in place of expert ids, reading a
    layer's misses together (`n_used`: choices per token, for the pool's counters). With
    `prefetch`, `guess(layer, experts)` starts reading the guessed experts of a coming layer on
    one background thread into free or evictable slots (never the current layer's experts);
    all slot bookkeeping stays on the calling thread, the worker only fills a reserved slot.
    """

    def __init__(
        self,
        layouts: Mapping[int, ExpertLayout],
        slots: int,
        prefetch: bool = False,
        evict: str = "lru",
        prepare: bool = False,
        pack_on: torch.device | None = None,
        n_used: int = 8,
        native=None,
    ):
        if slots < 1:
            raise ValueError("expert streaming needs at least one slot")
        if evict not in ("lru", "lfu"):
            raise ValueError(f"evict must be lru or lfu, not {evict!r}")
        if (prepare or pack_on) and any(lay.fmt is None for lay in layouts.values()):
            raise ValueError("preparing streamed experts needs every layout's fmt")
        self.layouts = dict(layouts)
        self.slot_bytes = max(lay.expert_nbytes for lay in self.layouts.values())
        self.prepare = prepare
        self.native = native  # prepared matrices on the native block linears (`prepare_expert`)
        # the most one slot's prepared expert holds (the largest layer's)
        self.prepared_slot_bytes = (
            max(prepared_format_nbytes(lay.fmt) for lay in self.layouts.values()) if prepare else 0
        )
        self.packed_pool = None if pack_on is None else self._device_pool(pack_on, slots, n_used)
        self._prepared: list[PreparedExpert | None] = [None] * slots  # per slot, with prepare
        self.n_slots, self.prefetch, self.evict = slots, prefetch, evict
        # packed on a device: the host only stages reads; else each slot holds its raw blocks
        self.ring = None
        if self.packed_pool is not None:
            # (a call reads at most `slots` experts, the prefetch thread one more)
            n = max(2, min(2 * STAGE_WAVE, slots + 1, STAGE_BYTES // self.slot_bytes))
            pin = pack_on.type == "cuda"
            self.ring = StagingRing(n, self.slot_bytes, pin)
            self.pool, self._views = self.ring.buffers, self.ring.views
        else:
            self.pool = torch.empty(slots, self.slot_bytes, dtype=torch.uint8)
            self._views = [memoryview(self.pool[i].numpy()) for i in range(slots)]
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> slot, oldest first
        self._free = list(range(slots - 1, -1, -1))
        self._loading: dict[tuple[int, int], tuple[int, Future]] = {}  # read-ahead in flight
        self._ahead: set[tuple[int, int]] = set()  # read ahead and not used yet
        self._uses: dict[tuple[int, int], int] = {}  # lfu: uses of each expert so far
        self._pinned: set[tuple[int, int]] = set()  # the current layer's experts
        self._guesses: dict[int, set[int]] = {}  # layer -> experts guessed for it
        self._worker = ThreadPoolExecutor(1, "expert-prefetch") if prefetch else None
        self._threads = threads = min(READ_THREADS, os.cpu_count() or 1)
        self._readers = ThreadPoolExecutor(threads, "expert-read") if threads > 1 else None
        self._lock = threading.Lock()  # the read counters, shared with the prefetch thread
        # opened up front: the prefetch thread must not race the caller on this dict
        paths = {r.path for lay in self.layouts.values() for r in lay.ranges}
        self._fds: dict[str, int] = {path: os.open(path, os.O_RDONLY) for path in paths}
        self.stats = ExpertStats()

    def _device_pool(self, device: torch.device, slots: int, n_used: int):
        """The slots as one packed pool on `device` (every layout must share one format)."""
        fmts = {lay.fmt for lay in self.layouts.values()}
        if len(fmts) != 1:
            raise ValueError(f"a packed slot pool holds one expert format, not {len(fmts)}")
        from localllm.kernels.moe.slot_pool import PackedSlotPool  # CUDA only: imports triton

        pool = PackedSlotPool(next(iter(fmts)), slots, n_used, device)
        self.prepared_slot_bytes = pool.slot_nbytes
        return pool

    @property
    def nbytes(self) -> int:
        """The most the slots hold: raw buffers + prepared or packed forms (host and device)."""
        return self.pool.numel() + self.n_slots * self.prepared_slot_bytes

    def _blocks(self, buf: int, layout: ExpertLayout) -> ExpertBlocks:
        parts, pos = [], 0
        for rows, rb in layout.shapes:
            parts.append(self.pool[buf, pos : pos + rows * rb].view(rows, rb))
            pos += rows * rb
        return ExpertBlocks(*parts)

    def _jobs(self, buf: int, layout: ExpertLayout, expert: int) -> list[tuple]:
        """The reads (fd, view, offset, path) that fill buffer `buf` with the expert."""
        pos, view, jobs = 0, self._views[buf], []
        for rng in layout.expert_ranges(expert):
            jobs.append((self._fds[rng.path], view[pos : pos + rng.nbytes], rng.offset, rng.path))
            pos += rng.nbytes
        return jobs

    def _read(self, slot: int, layout: ExpertLayout, expert: int) -> float:
        """Fill `slot` with the expert (and prepare or pack it); returns the seconds taken."""
        return self._read_many(layout, [(slot, expert)])

    def _read_many(self, layout: ExpertLayout, misses: list[tuple[int, int]]) -> float:
        """Fill each (slot, expert) of `misses` (one layer's; and prepare or pack it) and count
        the reads; returns the seconds taken. The bytes of up to STAGE_WAVE experts are pread in
        one share per reading thread. Touches only those slots' buffers (or, packed on a
        device, staging buffers taken from the ring) and prepared entries, and (under the lock)
        the counters."""
        total = 0.0
        for w in range(0, len(misses), STAGE_WAVE):
            wave = misses[w : w + STAGE_WAVE]
            for slot, _ in wave:
                self._prepared[slot] = None  # freed before the next one is made: the bound holds
            bufs = [self.ring.take() if self.ring is not None else slot for slot, _ in wave]
            try:
                seconds = self._read_wave(layout, wave, bufs)
            finally:  # (a failed read must not keep staging buffers from the next one)
                if self.ring is not None:
                    for b in bufs:
                        self.ring.give(b)
            total += seconds
        return total

    def _read_wave(self, layout: ExpertLayout, wave: list[tuple[int, int]], bufs: list[int]):
        """`_read_many`'s reads of one wave into `bufs` (slots' own buffers, or staging ones),
        then preparing or packing; returns the seconds taken."""
        pool = self.packed_pool
        t0 = time.perf_counter()
        jobs = [j for (_, e), b in zip(wave, bufs, strict=True) for j in self._jobs(b, layout, e)]
        parts = shares(jobs, self._threads)
        if len(parts) > 1 and self._readers is not None:  # preadv releases the GIL
            others = [self._readers.submit(pread_all, p) for p in parts[1:]]
            pread_all(parts[0])  # this thread reads a share too: one handoff fewer
            for f in others:
                f.result()
        else:
            pread_all(jobs)
        seconds = time.perf_counter() - t0
        with self._lock:
            self.stats.bytes_read += len(wave) * layout.expert_nbytes
            self.stats.read_seconds += seconds
        if not self.prepare and pool is None:
            return seconds
        t1 = time.perf_counter()
        for (slot, _), b in zip(wave, bufs, strict=True):
            if pool is None:
                made = prepare_expert(self._blocks(b, layout), layout.fmt, native=self.native)
            else:  # an upload that does not wait, packed into the slot in place
                made = pool.fill_mapped(slot, self.pool[b, : layout.expert_nbytes])
            self._prepared[slot] = made
        prep = time.perf_counter() - t1
        with self._lock:
            self.stats.prepared += len(wave)
            self.stats.prepare_seconds += prep
        return seconds + prep

    def _read_ahead(self, slot: int, layout: ExpertLayout, expert: int):
        """`_read` on the read-ahead thread (in inference mode, as the pool's tensors were
        made); for a CUDA pool, the event behind the upload and packing, which the stream that
        reads the slot waits for (`_settle`), else None."""
        with torch.inference_mode():
            self._read(slot, layout, expert)
        if self.packed_pool is None or self.packed_pool.pe.down.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _victim(self, keep: set[tuple[int, int]]) -> int | None:
        """A slot to reuse: a free one, else an evicted one outside `keep` (None: none)."""
        if self._free:
            return self._free.pop()
        candidates = (k for k in self._lru if k not in keep)
        if self.evict == "lfu":
            window = [k for k, _ in zip(candidates, range(LFU_WINDOW), strict=False)]
            key = min(window, key=lambda k: self._uses.get(k, 0), default=None)
        else:
            key = next(candidates, None)
        if key is None:
            return None
        self._ahead.discard(key)
        return self._lru.pop(key)

    def _settle(self, key: tuple[int, int], wanted: bool = True) -> None:
        """Wait for a read-ahead of `key` and make its slot an ordinary cached one; a wrong
        guess (`wanted` false) goes to the eviction end, so it is the first to go."""
        slot, fut = self._loading.pop(key)
        t0 = time.perf_counter()
        try:
            landed = fut.result()
        except Exception as e:  # e.g. an I/O error: the expert stays a miss, the slot free
            log.warning("read-ahead of layer %d expert %d failed: %s", *key, e)
            self._ahead.discard(key)
            self._free.append(slot)
            return
        finally:
            with self._lock:
                self.stats.stall_seconds += time.perf_counter() - t0
        if landed is not None:  # packed on the read-ahead thread: this stream reads after it
            torch.cuda.current_stream().wait_event(landed)
        self._lru[key] = slot
        if not wanted:
            self._lru.move_to_end(key, last=False)

    def fetch(self, layer: int, expert: int) -> ExpertBlocks | PreparedExpert:
        slot = self._lookup(layer, expert, keep_layer=False)
        if self.prepare or self.packed_pool is not None:
            return self._prepared[slot]
        return self._blocks(slot, self.layouts[layer])

    @property
    def together(self) -> int:
        return self.n_slots

    def fetch_together(self, layer: int, experts: list[int]) -> list[ExpertBlocks]:
        if self.prepare or self.packed_pool is not None:
            raise ValueError("raw blocks of slots that are prepared or packed")
        slots = self.slots_for(layer, experts)
        return [self._blocks(s, self.layouts[layer]) for s in slots]

    def slots_for(self, layer: int, experts: list[int]) -> list[int]:
        """The slot of each of `experts` (one layer's, after `routed`), reading the missing
        ones; all stay in place together, so there must be no more of them than slots."""
        if len(experts) > self.n_slots:
            raise ValueError(f"{len(experts)} experts do not fit in {self.n_slots} slots")
        self._pinned = self._pinned | {(layer, e) for e in experts}  # none evicts another
        misses: list[tuple[int, int]] = []  # (slot, expert), read together below
        slots = [self._lookup(layer, e, keep_layer=True, defer=misses) for e in experts]
        if misses:
            seconds = self._read_many(self.layouts[layer], misses)
            with self._lock:
                self.stats.stall_seconds += seconds
        return slots

    def _lookup(self, layer: int, expert: int, keep_layer: bool, defer=None) -> int:
        """The slot holding (layer, expert), read into one on a miss (or, with `defer`, the
        (slot, expert) appended there for the caller to read). `keep_layer`: never evict the
        layer's other experts (wait for read-aheads instead); else only prefer not to."""
        key = (layer, expert)
        self.stats.lookups += 1
        self._uses[key] = self._uses.get(key, 0) + 1
        if key in self._loading:
            self._settle(key)
        slot = self._lru.get(key)
        if slot is not None:
            self._lru.move_to_end(key)
            self.stats.hits += 1
            if key in self._ahead:
                self._ahead.discard(key)
                self.stats.prefetch_hits += 1
            return slot
        self.stats.misses += 1
        # spare the layer's other experts (a read-ahead may hold one it has yet to use)
        slot = self._victim(self._pinned)
        if slot is None and not keep_layer:
            slot = self._victim(set())
        while slot is None:  # every slot is being read ahead: take one when it lands
            if not self._loading:
                raise RuntimeError("no expert slot can be reused")
            self._settle(next(iter(self._loading)))
            slot = self._victim(self._pinned if keep_layer else set())
        self._lru[key] = slot
        if defer is not None:
            defer.append((slot, expert))
            return slot
        seconds = self._read(slot, self.layouts[layer], expert)
        with self._lock:
            self.stats.stall_seconds += seconds
        return slot

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        used = set(torch.unique(ids).tolist())
        self._pinned = {(layer, e) for e in used}
        guessed = self._guesses.pop(layer, None)
        if guessed is not None:
            self.stats.guessed += len(guessed)
            self.stats.guessed_right += len(guessed & used)
        for key in [k for k, (_, f) in self._loading.items() if f.done()]:
            self._settle(key, wanted=key[0] > layer or key in self._pinned)

    def drain(self) -> None:
        """Wait for every read-ahead in flight (they become ordinary cached experts)."""
        for key in list(self._loading):
            self._settle(key)

    def guess(self, layer: int, experts: list[int]) -> None:
        """Start reading `experts` of `layer` ahead (best guess first) into slots that hold
        none of the current layer's experts; what does not fit is skipped."""
        if self._worker is None or layer not in self.layouts:
            return
        self._guesses[layer] = set(experts)
        keep = self._pinned | set(self._loading)
        for e in experts:
            key = (layer, e)
            if key in self._lru or key in self._loading:
                continue
            slot = self._victim(keep | {key})
            if slot is None:
                return
            fut = self._worker.submit(self._read_ahead, slot, self.layouts[layer], e)
            self._loading[key] = (slot, fut)
            self._ahead.add(key)
            self.stats.prefetched += 1

    def close(self) -> None:
        if getattr(self, "_worker", None) is not None:
            self._worker.shutdown(wait=True)  # reads in flight finish and are counted
            self._worker = None  # later guesses are ignored
        if getattr(self, "_readers", None) is not None:
            self._readers.shutdown(wait=True)
            self._readers = None
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
        self._fds = {}

    def __del__(self):
        self.close()
