"""Decode CUDA graphs: the single-token forward (and its logits) captured once per shape, replayed.

Eager decode on a GPU is bound by Python dispatch (~1,300 torch ops and ~160 triton launches per
token). A graph is captured per (batch size from a small ladder, table width bucket) and fed
through fixed static buffers: one int64 row per sequence holding [token id, position, slot,
seq_len, recurrent-state slot, block table padded to the bucket]. Attention uses the device-built
padded plan (`padded_decode_plan`), and hybrid models' recurrent layers their state slots and
freshness (seq_len 1) from the same rows, so nothing in the captured region depends on host-side
lengths or slots. Rows past the real batch repeat row 0: they rewrite row 0's KV slot with the
same values, so they touch no other sequence's cache. A hybrid's padding rows cannot: their state
is not row 0's, so neither is what they would write. They take the scratch state slot
(`RecurrentState.scratch`, read as fresh) and a spare KV slot (`pad_slot`, no sequence's;
without one, a hybrid's step whose size is off the ladder runs eager). MoE layers
that need the host each step (experts streamed or computed on the CPU) split the capture into a
chain of graphs with their host steps between (`engine.runtime.graph_breaks`); layers that split
their experts with the CPU alone keep it one graph (`engine.moe.split_link`).
"""

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.moe.block import graph_safe, moe_blocks
from localllm.engine.moe.split_link import SplitLink
from localllm.engine.runtime.graph_breaks import HostBreaks
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.attention.decode_graph import PaddedPositions, padded_decode_plan
from localllm.kernels.attention.decode_plan import DecodePlan

log = logging.getLogger(__name__)

# batch sizes captured (lazily, on a step's first use); a step of more sequences runs eager. Up
# to 64: a server's many streams replay graphs too (issue 38: 8 put 99.9 % of the tokens at 64
# streams in eager steps); a step of 9-64 pads to the next size up
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
SPLIT_LINK = True  # split layers hand over by flags in one graph (False: graph breaks; benches)
MIN_BLOCKS = 16  # the smallest table-width bucket (256 tokens at block size 16)
COLS = 5  # id, position, slot, seq_len, state slot; the block table follows
STATE_SLOTS, STATE_FRESH = ("state_slots",), ("state_fresh",)  # `RecurrentState`'s plan keys


class _DevicePlans(dict):
    """`BatchMeta.plans` whose decode plans (and a hybrid's state slots and freshness) come from
    device tensors, built on first use by the first layer (inside the captured region) and reused
    by the others. `scratch`: the padding rows' state slot (None: the model keeps no state)."""

    def __init__(
        self, inputs: torch.Tensor, where: PaddedPositions, block_size: int, scratch: int | None
    ):
        super().__init__()
        self.inputs, self.where, self.block_size = inputs, where, block_size
        self.scratch = scratch

    def __contains__(self, key: object) -> bool:
        if isinstance(key, tuple) and key[:1] == ("decode",):
            return True
        return (self.scratch is not None and key in (STATE_SLOTS, STATE_FRESH)) or (
            super().__contains__(key)
        )

    def __missing__(self, key: tuple) -> "DecodePlan | torch.Tensor":
        if key == STATE_SLOTS:  # contiguous: the recurrent kernels index it as a plain array
            self[key] = self.inputs[:, 4].contiguous()
            return self[key]
        if key == STATE_FRESH:  # the sequence's first token, or a padding row
            self[key] = (self.inputs[:, 3] == 1) | (self.inputs[:, 4] == self.scratch)
            return self[key]
        tables, seq_lens = self.inputs[:, COLS:], self.inputs[:, 3]
        plan = padded_decode_plan(tables, seq_lens, self.where, self.block_size, key[1])
        self[key] = plan
        return plan


@dataclass(slots=True)
class _Graph:
    inputs: torch.Tensor  # [B, COLS + blocks] int64 static input
    logits: torch.Tensor | None  # [B, vocab] float32 static output
    graph: "torch.cuda.CUDAGraph | HostBreaks | None"  # one graph, or a chain with host steps
    link: SplitLink | None = None  # one graph whose split layers hand over to the CPU by flags


class DecodeGraphs:
    """Captured decode forwards of `model` over `kv`, keyed by (batch size, table width)."""

    def __init__(
        self,
        model: nn.Module,
        kv: PagedKVCache,
        batch_sizes=BATCH_SIZES,
        pad_slot: int | None = None,
    ):
        self.model, self.kv = model, kv
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.where: dict[int, PaddedPositions] = {}
        self.failed: str | None = None  # why capture failed (then every call falls back to eager)
        self.pool = None
        self._mapped = [b for b in moe_blocks(model) if b.mapped is not None]
        states = getattr(kv, "states", None)
        self.scratch = None if states is None else states.scratch
        # hybrids' padding rows: (their KV slot, their state slot); None: no padding rows
        self.pad = None if states is None or pad_slot is None else (pad_slot, states.scratch)

    def key(self, batch: int, blocks: int) -> tuple[int, ...] | None:
        """The graph shape for `batch` sequences of at most `blocks` blocks (None: run eager);
        with LoRA adapters loaded, whether a row of the step is on one (else no LoRA work)."""
        if self.failed is not None or batch > self.batch_sizes[-1] or batch < 1:
            return None
        b = next(s for s in self.batch_sizes if s >= batch)
        if b > batch and self.scratch is not None and self.pad is None:
            return None  # a hybrid without a spare KV slot for padding rows
        width = MIN_BLOCKS
        while width < blocks:
            width *= 2
        return (b, width, *lora_key(self.model))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The decode forward from a static input [B, COLS + blocks] -> float32 logits [B, vocab]
        (no host sync, shapes fixed by the input's; runs eagerly too, e.g. on CPU)."""
        b, blocks = inputs.shape[0], inputs.shape[1] - COLS
        bs = self.kv.block_size
        where = self.where.get(blocks)
        if where is None or where.pos.device != inputs.device:
            where = self.where[blocks] = PaddedPositions.make(blocks, bs, inputs.device)
        # Host-side layout only: B single-token sequences (the lengths/tables here are never read
        # by the attention, which takes the device plan from `plans`).
        meta = BatchMeta(
            tuple(range(b + 1)), (1,) * b, ((0,),) * b, inputs[:, 2], bs,
            plans=_DevicePlans(inputs, where, bs, self.scratch),
        )  # fmt: skip
        hidden = self.model(inputs[:, 0], inputs[:, 1], meta, self.kv)
        return self.model.logits(hidden).float()

    def run(self, inputs: torch.Tensor, ids: torch.Tensor | None = None, then=None):
        """Replay (capturing on first use) for inputs [n, COLS + w] int64 on any device, token ids
        from `ids` [n] on the device when given (a step fed the one before's tokens); returns
        logits [n, vocab] (a view of the graph's output: valid until the next call), or
        `then(logits)` when given, called once the replay is queued and before the host's own
        part of the step (the work it queues runs right behind the replay); None when this shape
        runs eager."""
        n, w = inputs.shape[0], inputs.shape[1] - COLS
        key = self.key(n, w)
        if key is None:
            return None
        g = self.graphs.get(key)
        first = g is None
        if first:
            g = _Graph(torch.zeros(key[0], COLS + key[1], dtype=torch.long, device=self.kv.device),
                       None, None)  # fmt: skip
        fill_rows(g.inputs, inputs, ids, self.pad)
        if first and not capture_first(self, key, g):
            return None
        for b in self._mapped:  # replays run no Python: mapped host experts count from here
            b.mapped.replayed(key[0])
        if g.link is None:
            g.graph.replay()
            return g.logits[:n] if then is None else then(g.logits[:n])
        g.link.arm()
        try:
            g.graph.replay()
            out = g.logits[:n] if then is None else then(g.logits[:n])
        except BaseException:
            g.link.release()
            raise
        g.link.run()  # the CPU's shares of the split layers, beside the replay
        return out

    def warm(self, batch: int, width: int, block: int, block_size: int) -> bool:
        """Capture the graph of `batch` rows whose tables are `width` blocks wide before any
        request needs it (`engine.runtime.warmup`). False once capture failed."""
        self.run(self.warm_rows(batch, width, block, block_size))
        return self.failed is None

    def warm_rows(self, batch: int, width: int, block: int, block_size: int) -> torch.Tensor:
        """`warm`'s host rows: every row at position 0 of `block`, a block no sequence owns,
        its table all that block (a hybrid's rows on the scratch state)."""
        rows = torch.zeros(batch, COLS + width, dtype=torch.long)
        rows[:, 2] = block * block_size
        rows[:, 3] = 1
        rows[:, COLS:] = block
        if self.scratch is not None:
            rows[:, 4] = self.scratch
        return rows

    def warm_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """The rows a capture's warm-up runs: `inputs`, or for a hybrid a copy with every row on
        the scratch state slot (fresh): its rows' states must not advance before the first
        replay does it. The KV it writes at their KV slots, from other states, the replay writes
        again before any attention reads them."""
        if self.scratch is None:
            return inputs
        warm = inputs.clone()
        warm[:, 4] = self.scratch
        return warm

    def _capture(self, g: _Graph) -> None:
        side = warm_up(self.forward, self.warm_inputs(g.inputs), self.kv.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if graph_safe(self.model, split=SPLIT_LINK):
            split = [b for b in moe_blocks(self.model) if b.split is not None]
            native = split[0].split.call.native if split else None
            link = SplitLink(native, len(split), self.kv.device) if split else None
            for b in split:
                b.link = link
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    g.logits = self.forward(g.inputs)
            finally:
                for b in split:
                    b.link = None
            g.graph, g.link = graph, link
            return
        # MoE layers that need the host: one graph piece between each two of their host steps
        chain, blocks = HostBreaks(self.pool), moe_blocks(self.model)
        for b in blocks:  # the warm-up's read-aheads land before capture starts
            b.source.drain()
            b.breaks = chain
        torch.cuda.synchronize(self.kv.device)
        try:
            with torch.cuda.stream(side):
                chain.begin()
                try:
                    g.logits = self.forward(g.inputs)
                    chain.end()
                except BaseException:
                    chain.abort()
                    raise
        finally:
            for b in blocks:
                b.breaks = None
        torch.cuda.current_stream(self.kv.device).wait_stream(side)
        g.graph = chain


def fill_rows(
    static: torch.Tensor,
    inputs: torch.Tensor,
    ids: torch.Tensor | None,
    pad: tuple[int, int] | None = None,
) -> None:
    """A graph's static rows [B, COLS + W] from a step's [n, COLS + w] (n <= B, w <= W; the
    table columns past w keep what they held: the length mask hides them), token ids from `ids`
    [n] when given. Rows past n repeat row 0 (its id too); `pad` (a hybrid's): their KV slot and
    state slot instead of row 0's."""
    n, cols = inputs.shape
    b = static.shape[0]
    static[:n, :cols].copy_(inputs, non_blocking=True)
    if b > n:
        static[n:, :cols].copy_(inputs[:1].expand(b - n, -1), non_blocking=True)
        if pad is not None:
            static[n:, 2].fill_(pad[0])
            static[n:, 4].fill_(pad[1])
    if ids is not None:
        static[:n, 0].copy_(ids)
        static[n:, 0].copy_(ids[:1].expand(b - n))


def lora_key(model: nn.Module) -> tuple[bool, ...]:
    """() without LoRA adapters, else (a row of this step is on one,): captures of steps on no
    adapter leave the adapters' kernels out (`engine.lora.delta`)."""
    lora = getattr(model, "lora", None)
    return () if lora is None else (bool(lora.active),)


def capture_first(owner, key, g) -> bool:
    """`owner._capture(g)` on a shape's first use, kept in `owner.graphs[key]`; False when an
    op cannot be captured (the reason in `owner.failed`: eager from then on)."""
    try:
        owner._capture(g)
    except Exception as e:
        owner.failed = f"{type(e).__name__}: {e}"
        log.warning("graph capture failed, eager from now on: %s", owner.failed)
        return False
    owner.graphs[key] = g
    return True


def warm_up(forward, inputs: torch.Tensor, device: torch.device) -> "torch.cuda.Stream":
    """`forward(inputs)` once on a side stream before a capture (triton compiles and autotunes,
    lazy weight preparation), with the real inputs: it writes the KV the replay writes again.
    Returns the side stream, the current one waiting for it."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward(inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    return side


def pack_decode(
    ids: list[int],
    positions: list[int],
    slots: list[int],
    tables: list[list[int]],
    shifts: list[int] | None = None,
    states: list[int] | None = None,
) -> torch.Tensor:
    """Host rows [B, COLS + max table length] for `DecodeGraphs.run` (seq_len = position + 1;
    short tables padded with block 0, which the length mask hides). `shifts`: what each row's
    rope position adds to its cache position (M-RoPE text after an image), or None; `states`:
    each row's recurrent-state slot (hybrid models), or None (0)."""
    n = len(ids)
    lengths = (len(positions), len(slots), len(tables), len(shifts or ids), len(states or ids))
    if any(k != n for k in lengths):
        raise ValueError(
            "pack_decode needs one id, position, slot, table (and shift, state slot) per row"
        )
    # numpy, and the tables in one pass: 64 rows of 144 blocks built as Python lists took ~2x
    # as long, twice a step (`engine.runtime.decode_ahead`)
    lens = np.fromiter(map(len, tables), np.int64, count=n)
    width = int(lens.max())
    rows = np.zeros((n, COLS + width), dtype=np.int64)
    pos = np.array(positions, dtype=np.int64)
    rows[:, 0] = ids
    rows[:, 1] = pos if shifts is None else pos + np.array(shifts, dtype=np.int64)
    rows[:, 2] = slots
    rows[:, 3] = pos + 1
    if states is not None:
        rows[:, 4] = states
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int64, count=int(lens.sum()))
    rows[:, COLS:][np.arange(width) < lens[:, None]] = flat
    return torch.from_numpy(rows)
