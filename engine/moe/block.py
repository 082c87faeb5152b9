"""The mixture-of-experts FFN shared by MoE families: router, top-k routing, grouped experts.

Submodules are named after the GGUF tensors (`ffn_gate_inp`, `ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`) so the loader's name walk fills them. Expert weights are not multiplied from
here directly: after loading, `attach(source)` gives the block an `ExpertSource` (resident
slices, or the disk-streaming slot cache) chosen by the residency plan; the math lives in
`kernels.moe`. Host-tier experts of a model on a device are computed on the CPU: only the
token rows and their routing cross, the expert weights stay where they are. Which source each
block gets, and the plan itself, are `engine.moe.residency`'s.
"""

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from localllm.engine.layers.linear import QuantLinear, without_bytes
from localllm.engine.layers.shared import DenseParam, GatedMLP
from localllm.engine.moe.expert_tensor import ExpertTensor
from localllm.engine.moe.split import SplitExperts
from localllm.engine.runtime.graph_breaks import HostBreaks
from localllm.kernels.cpu.native import NativeKernels
from localllm.kernels.cpu.rows_call import RowsCall, RowsScratch
from localllm.kernels.fused import QUANT_MAX_ROWS, WeightedRows
from localllm.kernels.moe import (
    ExpertBiases,
    ExpertBlocks,
    ExpertFormat,
    expert_ffn_grouped,
    route_scored,
    route_topk,
)
from localllm.kernels.moe.prepared import PreparedExpert
from localllm.offload import QuantWeight
from localllm.offload.expert_source import ExpertLayout, ExpertSource, ResidentExperts
from localllm.offload.file_experts import FileExperts
from localllm.offload.mapped_experts import MappedExperts

log = logging.getLogger(__name__)

# Host experts of a GPU model take the native kernels up to this many token rows; longer prompts
# keep torch's prepared GEMMs (2-core AMX Xeon, one Qwen3-30B-A3B layer, ms per call, native vs
# prepared: 3.2 / 3.9 at 1 row, 34.8 / 45.3 at 16, 80.4 / 95.3 at 64, 283.6 / 208.8 at 256).
NATIVE_MAX_T = 64
ROWS_MAX_T = 8  # decode rows of resident raw experts through one prepared call (`_decode_rows`)
# CUDA: scored routing without expert groups (GLM-4.5's, LFM2-MoE's sigmoid scores and choice
# bias) in one top-k launch (`triton_route.topk_scored_cuda`; decode's router GEMV before it)
# instead of ~8 torch ops a layer. On since an H200 timed it (2026-12-07 18:14-18:18 UTC,
# tests/perf/results/hybrid.md): LFM2-8B-A1B tg128 589.79 -> 816.05 t/s, its kernel tests
# passing on an H100 (tests/kernels/test_moe_route.py); False: the torch ops
SCORED_ROUTE_KERNEL = True
# Decode rows of a layer with shared experts deferred too (`sum_in_norm`): the shared output
# rides along as the `WeightedRows`' extra, which the next norm's kernel adds after the routed
# sum (the combine and the add, two launches a layer, gone: GLM-4.5-Air, Granite 4.0-H). Tested
# under the interpreter; not yet timed on a GPU, so off.
SHARED_IN_NORM = False


@dataclass(frozen=True)
class Routing:
    """DeepSeek-style routing knobs (the defaults are plain softmax top-k): `scoring` softmax or
    sigmoid, a learned choice bias (`exp_probs_b`), group-limited top-k, a weight scale."""

    scoring: str = "softmax"
    probs_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0


class MoEFeedForward(nn.Module):
    """Routed experts: top-k over `ffn_gate_inp` logits, then the grouped expert FFN; optional
    DeepSeek routing (`routing`) and always-on shared experts (`ffn_*_shexp`, `shared_hidden`)."""

    def __init__(
        self,
        layer: int,
        dim: int,
        hidden: int,
        n_expert: int,
        n_used: int,
        norm_topk_prob: bool = True,
        act: str = "silu",
        precise: bool = False,
        routing: Routing | None = None,
        shared_hidden: int = 0,
    ):
        super().__init__()
        self.layer, self.dim, self.hidden = layer, dim, hidden
        self.n_used, self.norm_topk_prob, self.act = n_used, norm_topk_prob, act
        self.routing, self.precise = routing, precise
        if routing is not None and routing.probs_bias:
            self.exp_probs_b = DenseParam(n_expert)
        self.shexp = GatedMLP(dim, shared_hidden, "silu", precise) if shared_hidden else None
        # The router decides which experts run: keep it fp32 so routing never flips on rounding.
        self.ffn_gate_inp = QuantLinear(dim, n_expert, precise=True)
        self.ffn_gate_exps = ExpertTensor(n_expert, hidden, dim)
        self.ffn_up_exps = ExpertTensor(n_expert, hidden, dim)
        self.ffn_down_exps = ExpertTensor(n_expert, dim, hidden)
        self.format: ExpertFormat | None = None
        self.source: ExpertSource | None = None
        self.packed = None  # `kernels.moe.packed.PackedExperts` when the experts sit on a GPU
        self._device = torch.device("cpu")  # where the current forward computes
        self.compute_on: torch.device | None = None  # host compute of host-tier experts
        self.native: NativeKernels | None = None  # C kernels: a CPU model's experts, host compute
        self.rows_scratch: RowsScratch | None = None  # shared by a model's `_decode_rows` calls
        self._rows_call: RowsCall | None = None
        self.guess_next: MoEFeedForward | None = None  # the next layer, told what to read ahead
        # the next layer, whose experts read at the GPU's request this one's step reads ahead
        self.read_ahead_next: MoEFeedForward | None = None
        self.breaks: HostBreaks | None = None  # set while a decode graph is captured in pieces
        self.link = None  # set while a decode graph with split layers is captured whole
        # host-tier experts the GPU reads in place, or disk-tier ones read at its request
        self.mapped: MappedExperts | FileExperts | None = None
        self.split: SplitExperts | None = None  # with `mapped`: the CPU computes a share too
        # Set by blocks whose next norm adds this output (`defers_residual`): resident experts on
        # a GPU then return decode rows unsummed (`WeightedRows`), and that norm's kernel sums them
        self.sum_in_norm = False
        self.routing_override = None  # `moe.routing_override.RoutingOverride` (bench --routing)

    @property
    def quant_rows(self) -> int:
        """Rows up to which this FFN reads its input quantized by the norm that made it: any
        number for experts packed on a GPU (the grouped GEMMs of prompts take int8 rows too)."""
        return 1 << 30 if self.packed is not None else QUANT_MAX_ROWS

    def expert_weights(self) -> tuple[QuantWeight, QuantWeight, QuantWeight]:
        return self.ffn_gate_exps.weight, self.ffn_up_exps.weight, self.ffn_down_exps.weight

    def stream_layout(self) -> ExpertLayout:
        """Where this layer's experts are in the file, for streaming them (before `release`)."""
        parts = [t.layout() for t in (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps)]
        ranges, shapes = tuple(r for r, _ in parts), tuple(s for _, s in parts)
        return ExpertLayout(self.ffn_gate_exps.shape[0], ranges, shapes, self.format)

    def fuse(self) -> None:
        """Set the expert format and, unless a plan attached another source, resident experts."""
        parts = (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps)
        if len({t.bias is None for t in parts}) > 1:  # the expert kernels take three or none
            raise ValueError(f"blk.{self.layer}: expert biases need gate, up and down, or none")
        g, u, d = self.expert_weights()
        self.format = ExpertFormat(g.qtype, u.qtype, d.qtype, self.dim, self.hidden, self.act)
        if self.shexp is not None:
            self.shexp.fuse()
        home = self.ffn_gate_exps.home or g.data.device  # (uploaded already: `read` load mode)
        if home.type == "cuda":
            self._to_device(home)
            g, u, d = self.expert_weights()
        if self.source is None:
            # CPU experts prepared on first use: a plan's source usually replaces this one first
            cpu = g.data.device.type == "cpu" and not self.precise
            prepared = {self.layer: self.format} if cpu else {}
            self.attach(
                ResidentExperts({self.layer: (g.data, u.data, d.data)}, prepared, lazy=True)
            )

    def _to_device(self, device: torch.device) -> None:
        """Experts that belong on a GPU: packed there for the dp4a kernels a few experts at a time
        (`pack_layer`: from host blocks, the layer's raw bytes never sit on the device, whose
        allocator would keep their blocks), else uploaded raw. The QuantWeights keep shape,
        bytes and file range for the plan."""
        from localllm.kernels.moe.packed import pack_layer, packable

        tensors = (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps)
        # (Q5_0 / Q4_0 / IQ4_NL experts widened to Q8_0: GLM-4.5-Air Q4_K_M's ffn_down_exps)
        if self.ffn_gate_exps.bias is None and packable(self.format, widen=True):
            g, u, d = (w.data for w in self.expert_weights())
            self.packed = pack_layer(g, u, d, self.format, self.n_used, device)
            for t in tensors:
                t.weight = without_bytes(t.weight, device)
            return
        for t in tensors:
            t.weight = dataclasses.replace(t.weight, data=t.weight.data.to(device))
            if t.bias is not None:
                t.bias = t.bias.to(device)

    def map_experts(self, slots: int, prompt_copy: bool = False, keep_raw: bool = False) -> None:
        """Host-tier experts read by this block's GPU from mapped host memory, the last used
        `slots` cached on the device (`offload.mapped_experts`; `prompt_copy`: prompts copy the
        layer to the device first); packed on the GPU a few experts at a time straight into the
        mapped copy, then the raw copies are released unless `keep_raw` (the CPU computes a
        share: `split`)."""
        from localllm.offload.mapped import map_packed_layer

        dev = self.ffn_gate_inp.weight.data.device
        g, u, d = (w.data for w in self.expert_weights())
        pe = map_packed_layer(g, u, d, self.format, self.n_used, dev)
        # (the mapper: `pe` is in mapped memory already)
        self.mapped = MappedExperts(pe, slots, self.n_used, lambda p: p, prompt_copy)
        self.packed = self.mapped.host
        if keep_raw:
            return
        for t in (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps):
            t.weight = without_bytes(t.weight)

    def request_experts(self, layout: ExpertLayout, slots: int, shared) -> None:
        """Disk-tier experts read at the GPU's request into `slots` device slots of this block
        (`offload.file_experts`, `shared`: its model's `FileSlots`); the file's blocks are
        released (they are read from the file)."""
        self.mapped = FileExperts(self.layer, layout, self.format, slots, self.n_used, shared)
        self.packed = self.mapped.host
        for t in (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps):
            t.release()

    def attach(self, source: ExpertSource) -> None:
        self.source = source

    def fetch(self, expert: int) -> ExpertBlocks | PreparedExpert:
        b = self.source.fetch(self.layer, expert)
        # host or disk tier feeding a device: one copy (prepared experts are CPU-only)
        if isinstance(b, ExpertBlocks) and b.gate.device != self._device:
            b = ExpertBlocks(*(t.to(self._device) for t in (b.gate, b.up, b.down)))
        return b

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for hidden states x [T, dim]."""
        weights, ids = self._route(x)
        if self.routing_override is not None:  # a measurement's drawn routing (bench --routing)
            ids = self.routing_override.choose(self.layer, weights, ids)
        return weights, ids

    def guess_experts(self, x: torch.Tensor) -> None:
        """Tell the source which experts this layer will probably use, from the previous
        layer's FFN input `x` through this layer's router (most tokens first, at most k)."""
        self.guess_from(self._route(x)[1])

    def guess_from(self, ids: torch.Tensor) -> None:
        """`guess_experts` from this layer's routing ids [T, k] of the previous layer's input."""
        counts = torch.bincount(ids.reshape(-1), minlength=self.ffn_gate_exps.shape[0])
        top = counts.topk(self.n_used)
        self.source.guess(self.layer, top.indices[top.values > 0].tolist())

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.reshape(-1, self.dim)
        r, w = self.routing, self.ffn_gate_inp.dense_weight()
        fused = x.is_cuda and w is not None and self.ffn_gate_inp.bias is None
        if fused and (r is None or (r.n_group == 1 and SCORED_ROUTE_KERNEL)):
            from localllm.kernels.moe import triton_route as tr

            few = x.shape[0] <= tr.ROUTE_MAX_T  # decode: the router GEMV kernel, else torch's GEMM
            if r is None and few:  # decode: two launches instead of ~6
                return tr.route_topk_cuda(x, w, self.n_used, self.norm_topk_prob)
            logits = tr.router_logits_cuda(x, w) if few else self.ffn_gate_inp(x)
            if r is None:
                return tr.topk_softmax_cuda(logits, self.n_used, self.norm_topk_prob)
            bias = self.exp_probs_b.value if r.probs_bias else None
            return tr.topk_scored_cuda(logits, self.n_used, r.scoring, bias, self.norm_topk_prob,
                                       r.scale)  # fmt: skip
        logits = self.ffn_gate_inp(x)
        if r is None:
            return route_topk(logits, self.n_used, self.norm_topk_prob)
        bias = self.exp_probs_b.value if r.probs_bias else None
        norm = self.norm_topk_prob
        return route_scored(
            logits, self.n_used, r.scoring, bias, r.n_group, r.topk_group, norm, r.scale
        )

    def forward(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        """`xq`: x's rows quantized by the norm that made x (resident packed experts use it)."""
        weights, ids = self.route(x)
        if self.split is not None and self.split.takes(ids):  # the GPU and the CPU together
            return self._split(x, xq, weights, ids)
        if self.breaks is not None and self.packed is None:  # captured, and needs the host
            return self._forward_captured(x, xq, weights, ids)
        return self.forward_routed(x, xq, weights, ids)

    def _split(self, x: torch.Tensor, xq, weights, ids) -> torch.Tensor:
        def gpu(x, xq, w, i):
            return self.mapped.ffn(x, w, i, self.format, xq)

        shared = self.shexp(x, xq) if self.shexp is not None else None
        y = self.split.ffn(x.reshape(-1, self.dim), xq, weights, ids, gpu, self.breaks, self.link)
        y = y.reshape(x.shape).to(x.dtype)
        return y + shared if shared is not None else y

    def forward_routed(self, x: torch.Tensor, xq, weights, ids) -> torch.Tensor:
        """The forward from the routing (weights, ids [T, k]) on, eagerly."""
        # a slot pool maps ids to slots on the host: one copy serves the source and the mapping
        host = ids.cpu() if getattr(self.source, "packed_pool", None) is not None else None
        self.source.routed(self.layer, ids if host is None else host)
        if self.guess_next is not None:  # reads for the next layer overlap this one's compute
            self.guess_next.guess_experts(x)
        # shared experts first: on a device their kernels run while the CPU does host experts
        shared = self.shexp(x, xq) if self.shexp is not None else None
        if self.compute_on is not None:
            y = self._routed_on_host(x, weights, ids)
        else:
            y = self._routed(x.reshape(-1, self.dim), weights, ids, xq, host)
        if isinstance(y, WeightedRows):  # (`_routed`; with shared experts: SHARED_IN_NORM)
            return y if shared is None else dataclasses.replace(y, extra=shared)
        y = y.reshape(x.shape).to(x.dtype)
        return y + shared if shared is not None else y

    def _forward_captured(self, x: torch.Tensor, xq, weights, ids) -> torch.Tensor:
        """The forward captured as graph pieces around a host step (`engine.runtime.graph_breaks`).
        Streamed experts kept packed on the GPU: the step reads the missing experts and writes
        the slot numbers; the grouped GEMVs over the slot pool stay in the next graph. Anything
        else: the step runs the eager forward from the routing on and writes its output."""
        pool = getattr(self.source, "packed_pool", None)
        # (more routed pairs than slots may not fit at once: the eager step's fallback then)
        fits = pool is not None and ids.shape[0] <= pool.max_tokens
        if fits and ids.numel() <= self.source.n_slots and self.compute_on is None:
            slots = torch.zeros_like(ids)  # static: written by the step, read by the next graph
            nxt = self.guess_next
            guess = nxt._route(x)[1] if nxt is not None else None  # in this graph, read after

            def step() -> None:
                host = ids.cpu()
                self.source.routed(self.layer, host)
                if guess is not None:
                    nxt.guess_from(guess.cpu())
                slots.copy_(self._slots(host))

            self.breaks.host(step)
            from localllm.kernels.moe.packed import expert_ffn_packed

            shared = self.shexp(x, xq) if self.shexp is not None else None
            y = expert_ffn_packed(x.reshape(-1, self.dim), weights, slots, pool.pe, self.format, xq)
            y = y.reshape(x.shape).to(x.dtype)
            return y + shared if shared is not None else y
        out = torch.empty_like(x)
        self.breaks.host(lambda: out.copy_(self.forward_routed(x, xq, weights, ids)))
        return out

    def _routed(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, xq=None, host=None
    ) -> torch.Tensor:
        """`host`: ids copied to the host already (streamed into a slot pool), or None."""
        self._device = x.device
        if self.packed is not None:  # resident on the GPU: routing never leaves the device
            from localllm.kernels.moe.packed import expert_ffn_packed

            if self.mapped is not None:  # host experts read by the GPU (and its slot cache)
                nxt = self.read_ahead_next  # (disk experts read at the GPU's request)
                if nxt is None or ids.shape[0] > self.mapped.rows:
                    return self.mapped.ffn(x, weights, ids, self.format, xq)
                guess = nxt._route(x)[1]  # the next layer's router on this layer's input
                return self.mapped.ffn(x, weights, ids, self.format, xq, guess=guess)
            # counted as Python runs it: replays of a captured decode graph are not counted
            self.source.stats.lookups += ids.numel()
            self.source.stats.hits += ids.numel()
            alone = self.shexp is None or SHARED_IN_NORM
            defer = self.sum_in_norm and alone and x.dtype == torch.float32
            return expert_ffn_packed(x, weights, ids, self.packed, self.format, xq, defer)
        pool = getattr(self.source, "packed_pool", None)
        if pool is not None and ids.shape[0] <= pool.max_tokens:
            slots = self._slots(ids if host is None else host)
            if slots is not None:  # the resident kernels over the slot pool: same bits
                from localllm.kernels.moe.packed import expert_ffn_packed

                slots = slots.to(x.device)
                return expert_ffn_packed(x, weights, slots, pool.pe, self.format, xq)
        parts = (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps)
        biases = ExpertBiases(*(t.bias for t in parts)) if parts[0].bias is not None else None
        if self.native is not None and self.compute_on is None and not x.is_cuda:
            return self._native(x, weights, ids)
        if (x.is_cuda or pool is not None) and biases is None:
            from localllm.kernels.moe.packed import expert_ffn_fetched, packable

            # streamed or host-copied: the same math as resident
            if packable(self.format, widen=True):
                n_expert = self.ffn_gate_exps.shape[0]
                return expert_ffn_fetched(x, weights, ids, self.fetch, self.format, n_expert)
        return expert_ffn_grouped(x, weights, ids, self.fetch, self.format, biases)

    def _decode_rows(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """Decode rows of resident raw experts through the native kernels' prepared call
        (`kernels.cpu.rows_call`: moe_ffn's bits without its ~20 torch ops); None otherwise."""
        if ids.shape[0] > ROWS_MAX_T or not isinstance(self.source, ResidentExperts):
            return None
        if self._rows_call is None:
            f, raw = self.format, tuple(w.data for w in self.expert_weights())
            types = (f.gate, f.up, f.down)
            self._rows_call = RowsCall(self.native, raw, types, f.act, ROWS_MAX_T, self.n_used,
                                       self.rows_scratch)  # fmt: skip
        flat = ids.reshape(-1).tolist()
        used = len(set(flat))  # counted as the resident source counts fetches
        self.source.stats.lookups += used
        self.source.stats.hits += used
        return self._rows_call(x, weights, flat)

    def _native(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A CPU model's routed experts through the native kernels over the raw blocks, as
        many experts at once as the source keeps valid together (slots), one at a time past
        that (a prompt routed to more experts than slots)."""
        y = self._decode_rows(x, weights, ids)
        if y is not None:
            return y
        used = torch.unique(ids).numel()
        at_once = self.source.together
        if at_once is not None and used > at_once:
            at_once = 1

        def fetch(experts: list[int]) -> list[tuple[torch.Tensor, ...]]:
            if at_once == 1:
                b = self.source.fetch(self.layer, experts[0])
                return [(b.gate, b.up, b.down)]
            return [(b.gate, b.up, b.down) for b in self.source.fetch_together(self.layer, experts)]

        f = self.format
        return self.native.moe_ffn_fetched(
            x, weights, ids, fetch, (f.gate, f.up, f.down), f.act, at_once=at_once
        )

    def _slots(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Host `ids` [T, k] as the host slot numbers of a streamed packed pool, the missing
        experts read in; None when the layer's experts outnumber the slots."""
        flat = ids.reshape(-1).tolist()
        experts = sorted(set(flat))
        if len(experts) > self.source.n_slots:
            return None
        slot = dict(zip(experts, self.source.slots_for(self.layer, experts), strict=True))
        return torch.tensor([slot[e] for e in flat], dtype=torch.int64).view(ids.shape)

    def _routed_on_host(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Host-tier experts computed where their weights are: the token rows and their routing
        go to `compute_on`, the combined result comes back (weights never move)."""
        host = self.compute_on
        rows = x.reshape(-1, self.dim).to(host)
        self.source.stats.host_rows += rows.shape[0]
        weights, ids = weights.to(host), ids.to(host)
        # a GPU model's long prompts keep the prepared path; a CPU model has no other
        local = x.device == host
        y = self._decode_rows(rows, weights, ids) if self.native is not None else None
        if y is None and self.native is not None and (rows.shape[0] <= NATIVE_MAX_T or local):
            used = torch.unique(ids).numel()  # counted as the resident source counts fetches
            self.source.stats.lookups += used
            self.source.stats.hits += used
            fmt = self.format
            blocks = (w.data for w in self.expert_weights())
            types = (fmt.gate, fmt.up, fmt.down)
            y = self.native.moe_ffn(rows, weights, ids, *blocks, types, fmt.act)
        elif y is None:
            y = self._routed(rows, weights, ids)
        return y.to(x.dtype).to(x.device)

    def compute_on_host(self, host: torch.device, native: "NativeKernels | None" = None) -> None:
        """Run this block's routed experts on `host` (their tier), biases included; with
        `native` (kernels that take this block's format), decode steps' experts run there in
        one call over the raw blocks (prompts keep the prepared path)."""
        self.compute_on, self.native = host, native
        for t in (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps):
            if t.bias is not None:
                t.bias = t.bias.to(host)


def use_native_cpu_experts(model: nn.Module, native: NativeKernels | None) -> None:
    """A CPU model's MoE blocks take the native kernels the loader loaded (None: none built)
    where they take the block's format: their default sources then hold the raw blocks alone,
    nothing prepared. Other blocks (experts with biases, gpt-oss's clamped SwiGLU, types the
    fused expert kernels lack) prepare their experts over the native block linears where those
    take the types (MXFP4 among them: views of the blocks, not per-call dequantized tiles).
    Precise blocks keep their paths."""
    blocks = [
        b
        for b in moe_blocks(model)
        if b.ffn_gate_inp.weight.data.device.type == "cpu" and not b.precise
    ]
    if native is None:
        return
    scratch = RowsScratch()  # one decode call at a time: the layers share its buffers
    for b in blocks:
        f, raw = b.format, {b.layer: tuple(w.data for w in b.expert_weights())}
        fused = b.ffn_gate_exps.bias is None
        if fused and native.supports(f.gate, f.up, f.down, f.dim, f.hidden, f.act):
            b.native, b.rows_scratch = native, scratch
            b.attach(ResidentExperts(raw))
        else:  # prepared on first use, each matrix on the block linears where they take it
            b.attach(ResidentExperts(raw, {b.layer: f}, lazy=True, native=native))


def moe_blocks(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def graph_safe(model: nn.Module, split: bool = False) -> bool:
    """Whether a decode step can be captured as one CUDA graph: every MoE block (if any) computes
    resident packed experts on the device, so no routing decision reaches the host (otherwise
    `DecodeGraphs` captures it in pieces around the blocks' host steps); `split`: blocks that
    split their experts with the CPU count too (they hand over by flags,
    `engine.moe.split_link`)."""
    return all(
        b.packed is not None
        and b.compute_on is None
        and b.guess_next is None
        and (split or b.split is None)
        for b in moe_blocks(model)
    )


def account_mapped(model: nn.Module) -> None:
    """Bring the mapped host experts' device-side counters into their sources' stats now."""
    for b in moe_blocks(model):
        if b.mapped is not None:
            b.mapped.account()
