"""Prompt CUDA graphs: a prompt chunk's forward captured once per padded length, then replayed.

A GPU prompt of a few hundred tokens is bound by host dispatch: a MoE layer launches ~22 kernels
and ~25 torch ops, ~1.3 ms of Python against ~0.8 ms of kernels, and how far the host falls
behind moved a 512-token prompt's speed 1.8x between runs. A chunk of one sequence needs nothing
host-side but its token count once its block table and lengths are device tensors
(`BatchMeta.context`; attention reads the blocks through the table), so its forward is captured
per length bucket and replayed for any context. Rows past the chunk up to the bucket are padding
(token 0 at the chunk's last position, k/v written to `spare_slot`, a slot no sequence owns):
causal attention keeps them out of every real row, and every other op is row by row.

Hybrid models (recurrent state) whose recurrent layers take the step's layout from the device
(`state_in_prompt_graphs`: granitehybrid, lfm2, qwen3next) may replay prompt graphs too, with
STATEFUL on: the chunk's state slot is a static input beside its context, and the padding rows
form a second sequence on the scratch state slot (`engine.layers.recurrent.prompt_graph_plans`),
so a scan stops at the chunk's last real row (Qwen3-Next's DeltaNet layers zero the padding's
decay and write strength instead; on by default since measured on a GPU, below).

`declined` says which models keep eager prompts: any host step in the forward would fail the
capture or freeze one chunk's values into every replay. Among them, attention heads that the
device-context kernel does not take (`kernels.attention.context_heads`): their context is read
on the host. tests/engine/test_prompt_graph_host_ops.py checks on the CPU that a taken model's
captured forward holds no host step.
"""

from dataclasses import dataclass

import torch
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.layers.recurrent import prompt_graph_plans
from localllm.engine.moe.block import graph_safe, moe_blocks
from localllm.engine.runtime.cuda_graphs import capture_first, lora_key, warm_up
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.attention.context_heads import context_heads

# ~1.5x apart: padding costs at most a third of a bucket's device time
BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# Prompt graphs for hybrid models (see above). On since an H100 measured them (2026-12-06 23:34
# UTC, tests/perf/results/hybrid.md): Granite-4.0-H-Tiny's 512-token forward 126.9 ms eager
# (host-bound) against 29.6 ms replayed, the hybrid prompt-graph GPU tests passing in that call
STATEFUL = True


def declined(model: nn.Module, kv: PagedKVCache) -> str | None:
    """Why `model`'s prompt chunks over `kv` cannot be captured on a GPU, or None: a capture
    holds no host step, so every op of the forward must take its layout from the device."""
    if not getattr(model, "generates", True):
        return "not a causal decoder (padding must stay out of real rows)"
    if kv.k_scales is not None:
        return "an 8-bit KV cache (decodes eagerly)"
    d, dv = kv.k[0].shape[-1], kv.v[0].shape[-1]
    if not context_heads(d, dv):  # the context would be read on the host
        return f"head dims {d} / {dv}: no device-context attention kernel"
    if not graph_safe(model) or any(b.mapped is not None for b in moe_blocks(model)):
        return "experts not resident and packed on the device (routing reaches the host)"
    if getattr(kv, "states", None) is not None:
        if not getattr(model, "state_in_prompt_graphs", False):
            return "recurrent layers that walk the host's sequence layout"
        if not STATEFUL:
            return "recurrent state, and prefill_graphs.STATEFUL is off"
    return None


def bucket_of(n: int) -> int | None:
    """The smallest bucket that holds `n` tokens (None: too short to pay, or too long)."""
    return next((b for b in BUCKETS if b >= n), None) if n >= BUCKETS[0] else None


@dataclass(slots=True)
class _Graph:
    inputs: torch.Tensor  # [3, P] int64: ids, positions, slots (static)
    hidden: torch.Tensor | None  # [P, dim] static output
    graph: "torch.cuda.CUDAGraph | None"


class PrefillGraphs:
    """Captured prompt-chunk forwards of `model` over `kv`, keyed by padded length; one
    sequence's block table of up to `max_blocks` blocks."""

    def __init__(self, model: nn.Module, kv: PagedKVCache, spare_slot: int, max_blocks: int,
                 pool=None):  # fmt: skip
        if not 0 <= spare_slot < kv.num_blocks * kv.block_size:
            raise ValueError(f"spare slot {spare_slot} is outside the cache")
        self.model, self.kv, self.spare_slot = model, kv, spare_slot
        dev = kv.device
        self.table = torch.zeros(max_blocks, dtype=torch.long, device=dev)  # static, shared
        # first position, length after, the chunk's recurrent-state slot (hybrids)
        self.ctx = torch.zeros(3, dtype=torch.long, device=dev)
        self.graphs: dict = {}  # padded length (and LoRA on, `lora_key`) -> graph
        self.pool = pool  # a graph memory pool shared with the decode graphs (or None: own)
        self.failed: str | None = None  # why capture failed (then every prompt runs eager)
        self.states = getattr(kv, "states", None)  # hybrids' state slots (None: no state)
        self.declined = declined(model, kv)  # why this model's prompts stay eager (None: none)
        self.usable = dev.type == "cuda" and self.declined is None

    def bucket(self, n: int) -> int | None:
        """The padded length that a chunk of `n` tokens replays at (None: eager)."""
        return bucket_of(n) if self.usable and self.failed is None else None

    def fill(self, inputs: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, start: int,
             table: list[int], state_slot: int = 0) -> None:  # fmt: skip
        """Write a chunk of n tokens at positions start.. into static inputs [3, P] and the
        context: ids, positions, slots, then the padding (token 0 at the chunk's last position,
        the spare slot); the table and (start, start + n, state_slot)."""
        n, p = ids.shape[0], inputs.shape[1]
        inputs[0, :n].copy_(ids)
        inputs[0, n:].zero_()
        pos = torch.arange(start, start + p, device=inputs.device)
        torch.clamp(pos, max=start + n - 1, out=inputs[1])
        inputs[2, :n].copy_(slots)
        inputs[2, n:].fill_(self.spare_slot)
        host = torch.tensor([start, start + n, state_slot, *table], dtype=torch.long)
        both = host.to(inputs.device, non_blocking=False)
        self.ctx.copy_(both[:3])
        self.table[: len(table)].copy_(both[3:])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model over static inputs [3, P] and the context -> hidden [P, dim] (no host
        sync)."""
        p = inputs.shape[1]
        meta = BatchMeta((0, p), (p,), ((),), inputs[2], self.kv.block_size,
                         context=(self.table, self.ctx[:2]))  # fmt: skip
        if self.states is not None:
            prompt_graph_plans(meta, self.kv, self.ctx)
        return self.model(inputs[0], inputs[1], meta, self.kv)

    def run(self, ids: torch.Tensor, slots: torch.Tensor, start: int, table: list[int],
            state_slot: int = 0) -> torch.Tensor | None:  # fmt: skip
        """Hidden states [n, dim] of a chunk of one sequence: `ids` and `slots` [n] on the
        model's device at positions start..start+n-1, `table` its block table (host ints),
        `state_slot` its recurrent-state slot (hybrids); or None when it runs eager. A view of
        the graph's output: valid until the next call."""
        n = ids.shape[0]
        p = self.bucket(n)
        if p is None or len(table) > self.table.shape[0]:
            return None
        on = lora_key(self.model)  # LoRA: steps on no adapter replay a capture without them
        key = (p, *on) if on else p
        g = self.graphs.get(key)
        first = g is None
        if first:
            g = _Graph(torch.zeros(3, p, dtype=torch.long, device=self.kv.device), None, None)
        self.fill(g.inputs, ids, slots, start, table, state_slot)
        if first and not capture_first(self, key, g):
            return None
        g.graph.replay()
        return g.hidden[:n]

    def warm(self, length: int, block: int, block_size: int) -> bool:
        """Capture the graph of a `length`-token chunk before any prompt needs it
        (`engine.runtime.warmup`): its tokens at positions 0.. of `block`, a block no sequence
        owns, every write to its first slot. False once capture failed."""
        dev = self.kv.device
        ids = torch.zeros(length, dtype=torch.long, device=dev)
        slots = torch.full((length,), block * block_size, dtype=torch.long, device=dev)
        scratch = 0 if self.states is None else self.states.scratch  # (a state nobody owns)
        self.run(ids, slots, 0, [block] * -(-length // block_size), scratch)
        return self.failed is None

    def _capture(self, g: _Graph) -> None:
        real = self.ctx.clone()
        if self.states is not None:  # the warm-up must not advance the chunk's state before
            # the replay does: it runs from position 0 on the scratch slot (the KV it writes at
            # the chunk's slots the replay writes again)
            n = real[1] - real[0]
            self.ctx.copy_(torch.stack([torch.zeros_like(n), n, n * 0 + self.states.scratch]))
        warm_up(self.forward, g.inputs, self.kv.device)  # compiles for this length
        self.ctx.copy_(real)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            g.hidden = self.forward(g.inputs)
        g.graph = graph
