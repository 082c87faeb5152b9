"""The mixture-of-experts FFN shared by MoE families: router, top-k routing, grouped experts.

Submodules are named after the GGUF tensors (`ffn_gate_inp`, `ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`) so the loader's name walk fills them. Expert weights are not multiplied from
here directly: after loading, `attach(source)` gives the block an `ExpertSource` (resident
slices, or the disk-streaming slot cache) chosen by the residency plan; the math lives in
`kernels.moe`. Host-tier experts of a model on a device are computed on the CPU: only the
token rows and their routing cross, the expert weights stay where they are.
"""

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from localllm.engine.layers import DenseParam, GatedMLP, QuantLinear, dense, without_bytes
from localllm.engine.models import model_module
from localllm.kernels.moe import (
    ExpertBiases,
    ExpertBlocks,
    ExpertFormat,
    expert_ffn_grouped,
    route_scored,
    route_topk,
)
from localllm.kernels.moe.prepared import PreparedExpert, prepared_expert_nbytes
from localllm.kernels.quant.linear import choose_strategy
from localllm.offload import ByteRange, QuantWeight
from localllm.offload.expert_cache import (
    ExpertLayout,
    ExpertSource,
    ExpertStats,
    ResidentExperts,
    StreamedExperts,
)
from localllm.offload.memory import MemoryInfo, probe_memory
from localllm.offload.plan import ResidencyPlan, expert_layer, plan_residency
from localllm.offload.reader import read_range
from localllm.offload.residency import ResidencyConfig

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from localllm.engine.gguf import GGUFModel
    from localllm.engine.gguf.model import TensorInfo

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
PLAN_KV_TOKENS = 8192  # KV the plan reserves when no context length is given
SCRATCH_TOKENS = 512  # tokens per step the scratch estimate allows for (the engine's default)


class ExpertTensor(nn.Module):
    """One `ffn_*_exps` tensor: [n_expert, rows, cols] raw ggml blocks, one slice per expert."""

    def __init__(self, n_expert: int, rows: int, cols: int):
        super().__init__()
        self.shape = (n_expert, rows, cols)
        self.weight: QuantWeight | None = None
        self.bias: torch.Tensor | None = None  # [n_expert, rows] float32 (gpt-oss), always held
        self.streamed = False  # disk tier: the blocks are not held, a streamer reads them

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix == "bias" and tuple(w.shape) == self.shape[:2]:
            self.bias = dense(w)
            return
        if suffix != "weight" or tuple(w.shape) != self.shape:
            raise ValueError(f"expected expert weight {self.shape}, got {tuple(w.shape)}")
        self.weight = w

    @property
    def loaded(self) -> bool:
        return self.weight is not None or self.streamed

    def layout(self) -> tuple[ByteRange, tuple[int, int]]:
        """Where the whole tensor is in the file and one expert's uint8 shape [rows, rb]."""
        w = self.weight
        if w.source is None or w.source.nbytes != w.nbytes:
            raise ValueError("expert streaming needs weights that come straight from a file")
        return w.source, (w.data.shape[1], w.data.shape[2])

    def release(self) -> None:
        """Stop holding the blocks (the disk tier reads them on demand)."""
        self.weight, self.streamed = None, True


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
        self.guess_next: Callable[[torch.Tensor], None] | None = None  # next layer's prefetch

    def expert_weights(self) -> tuple[QuantWeight, QuantWeight, QuantWeight]:
        return self.ffn_gate_exps.weight, self.ffn_up_exps.weight, self.ffn_down_exps.weight

    def fuse(self) -> None:
        """Set the expert format and, unless a plan attached another source, resident experts."""
        g, u, d = self.expert_weights()
        self.format = ExpertFormat(g.qtype, u.qtype, d.qtype, self.dim, self.hidden, self.act)
        if self.shexp is not None:
            self.shexp.fuse()
        if g.data.is_cuda and self.ffn_gate_exps.bias is None:
            self._pack_on_device()
        if self.source is None:
            # CPU experts prepared on first use: a plan's source usually replaces this one first
            cpu = g.data.device.type == "cpu" and not self.precise
            prepared = {self.layer: self.format} if cpu else {}
            self.attach(
                ResidentExperts({self.layer: (g.data, u.data, d.data)}, prepared, lazy=True)
            )

    def _pack_on_device(self) -> None:
        """Experts uploaded to a GPU are re-laid out once for the dp4a kernels; the raw device
        copy is then freed (the QuantWeights keep shape, bytes and file range for the plan)."""
        from localllm.kernels.moe.packed import pack_experts, packable

        if not packable(self.format):
            return
        g, u, d = self.expert_weights()
        self.packed = pack_experts(g.data, u.data, d.data, self.format, self.n_used)
        for t in (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps):
            t.weight = without_bytes(t.weight)

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
        return self._route(x)

    def guess_experts(self, x: torch.Tensor) -> None:
        """Tell the source which experts this layer will probably use, from the previous
        layer's FFN input `x` through this layer's router (most tokens first, at most k)."""
        ids = self._route(x)[1].reshape(-1)
        counts = torch.bincount(ids, minlength=self.ffn_gate_exps.shape[0])
        top = counts.topk(self.n_used)
        self.source.guess(self.layer, top.indices[top.values > 0].tolist())

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.ffn_gate_inp(x.reshape(-1, self.dim))
        r = self.routing
        if r is None:
            return route_topk(logits, self.n_used, self.norm_topk_prob)
        bias = self.exp_probs_b.value if r.probs_bias else None
        norm = self.norm_topk_prob
        return route_scored(
            logits, self.n_used, r.scoring, bias, r.n_group, r.topk_group, norm, r.scale
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        self.source.routed(self.layer, ids)
        if self.guess_next is not None:  # reads for the next layer overlap this one's compute
            self.guess_next(x)
        # shared experts first: on a device their kernels run while the CPU does host experts
        shared = self.shexp(x) if self.shexp is not None else None
        if self.compute_on is not None:
            y = self._routed_on_host(x, weights, ids)
        else:
            y = self._routed(x.reshape(-1, self.dim), weights, ids)
        y = y.reshape(x.shape).to(x.dtype)
        return y + shared if shared is not None else y

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self._device = x.device
        if self.packed is not None:  # resident on the GPU: routing never leaves the device
            from localllm.kernels.moe.packed import expert_ffn_packed

            # counted as Python runs it: replays of a captured decode graph are not counted
            self.source.stats.lookups += ids.numel()
            self.source.stats.hits += ids.numel()
            return expert_ffn_packed(x, weights, ids, self.packed, self.format)
        parts = (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps)
        biases = ExpertBiases(*(t.bias for t in parts)) if parts[0].bias is not None else None
        if x.is_cuda and biases is None:
            from localllm.kernels.moe.packed import expert_ffn_fetched, packable

            if packable(self.format):  # streamed or host-copied: the same math as resident
                return expert_ffn_fetched(x, weights, ids, self.fetch, self.format)
        return expert_ffn_grouped(x, weights, ids, self.fetch, self.format, biases)

    def _routed_on_host(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Host-tier experts computed where their weights are: the token rows and their routing
        go to `compute_on`, the combined result comes back (weights never move)."""
        host = self.compute_on
        rows = x.reshape(-1, self.dim).to(host)
        self.source.stats.host_rows += rows.shape[0]
        y = self._routed(rows, weights.to(host), ids.to(host))
        return y.to(x.dtype).to(x.device)

    def compute_on_host(self, host: torch.device) -> None:
        """Run this block's routed experts on `host` (their tier), biases included."""
        self.compute_on = host
        for t in (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps):
            if t.bias is not None:
                t.bias = t.bias.to(host)


def moe_blocks(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def _on_cpu(b: MoEFeedForward) -> bool:
    """The block computes its routed experts on the CPU (a CPU model, or host compute) with
    prepared experts (precise runs keep the exact raw-block path)."""
    on_cpu = b.ffn_gate_inp.weight.data.device.type == "cpu" or b.compute_on is not None
    return on_cpu and not b.precise


def _pack_on(disk: list[MoEFeedForward]) -> torch.device | None:
    """The GPU whose kernels compute the streamed experts, when it can keep them packed."""
    dev = {b.ffn_gate_inp.weight.data.device for b in disk}
    if len(dev) != 1 or next(iter(dev)).type != "cuda":
        return None
    from localllm.kernels.moe.packed import packable  # CUDA only: imports triton

    ok = all(packable(b.format) and b.ffn_gate_exps.bias is None for b in disk)
    return next(iter(dev)) if ok else None


def graph_safe(model: nn.Module) -> bool:
    """Whether a decode step can be captured in a CUDA graph: every MoE block (if any) computes
    resident packed experts on the device, so no routing decision reaches the host."""
    return all(
        b.packed is not None and b.compute_on is None and b.guess_next is None
        for b in moe_blocks(model)
    )


def apply_residency(model: nn.Module, plan: ResidencyPlan) -> list[ExpertSource]:
    """Give every MoE block its expert source from the plan: resident layers share one
    `ResidentExperts`, disk layers one `StreamedExperts` (their blocks are then released).
    Host-tier layers compute on the CPU unless the plan says `host_compute = device` (on a
    CPU-only run that dispatch moves nothing)."""
    tiers = plan.expert_tiers()
    blocks = moe_blocks(model)
    resident = {b.layer: tuple(w.data for w in b.expert_weights()) for b in blocks}
    disk = [b for b in blocks if tiers.get(b.layer) == "disk"]
    sources: list[ExpertSource] = []
    if disk:
        layouts = {}
        for b in disk:
            parts = [t.layout() for t in (b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps)]
            ranges, shapes = tuple(r for r, _ in parts), tuple(s for _, s in parts)
            layouts[b.layer] = ExpertLayout(b.ffn_gate_exps.shape[0], ranges, shapes, b.format)
            del resident[b.layer]
        st = plan.streaming
        prepare = all(_on_cpu(b) for b in disk)  # a device model gets its disk experts raw
        streamed = StreamedExperts(
            layouts, st.slots, st.prefetch, st.evict, prepare=prepare, pack_on=_pack_on(disk)
        )
        for b in disk:
            b.attach(streamed)
            for t in (b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps):
                t.release()
        if st.prefetch:  # each block guesses for the next one when that one streams
            for b, nxt in itertools.pairwise(blocks):
                if nxt in disk:
                    b.guess_next = nxt.guess_experts
        sources.append(streamed)
    if resident:
        for b in blocks:
            if tiers.get(b.layer) == "host" and plan.host_compute == "host":
                b.compute_on_host(torch.device("cpu"))
        prepared = {b.layer: b.format for b in blocks if b.layer in resident and _on_cpu(b)}
        shared = ResidentExperts(resident, prepared)
        for b in blocks:
            if b.layer in resident:
                b.attach(shared)
        sources.append(shared)
    return sources


def expert_stats(sources: list[ExpertSource]) -> ExpertStats:
    """Counters summed over the sources (hits + misses = lookups)."""
    total = ExpertStats()
    for s in sources:
        st = s.stats
        total.lookups += st.lookups
        total.hits += st.hits
        total.misses += st.misses
        total.bytes_read += st.bytes_read
        total.stall_seconds += st.stall_seconds
        total.prefetched += st.prefetched
        total.host_rows += st.host_rows
        total.read_seconds += st.read_seconds
        total.prefetch_hits += st.prefetch_hits
        total.guessed += st.guessed
        total.guessed_right += st.guessed_right
        total.prepared += st.prepared
        total.prepare_seconds += st.prepare_seconds
    return total


def plan_model(
    gguf: "GGUFModel",
    config: ResidencyConfig,
    kv_tokens: int | None = None,
    memory: MemoryInfo | None = None,
    precise: bool = False,
) -> ResidencyPlan:
    """The residency plan of a GGUF model from its header alone (no weight is read).

    Tensor sizes are what holding them costs (see `_memory_cost`); KV is estimated in f16 for
    `kv_tokens` (default: the model's context, at most PLAN_KV_TOKENS; the engine sizes the
    real KV pool from what is free after loading).
    """
    embd = gguf.tensors.get("token_embd.weight")
    args = model_module(gguf.architecture or "").ModelArgs.from_gguf(
        gguf.metadata, embd.shape[0] if embd else 0
    )
    tokens = kv_tokens or min(args.context_length, PLAN_KV_TOKENS)
    kv_heads = getattr(args, "n_kv_heads", args.n_heads)  # encoders (bert) have no KV cache
    kv_bytes = 2 * args.n_layers * kv_heads * args.head_dim * 2 * tokens
    tied = "output.weight" not in gguf.tensors
    # a prefill chunk's activations and logits, and up to three dequantized experts in flight
    expert_f32 = 3 * args.dim * getattr(args, "expert_hidden_dim", args.hidden_dim) * 4
    scratch = SCRATCH_TOKENS * (args.vocab_size + 8 * args.dim) * 4
    scratch += 3 * expert_f32 if getattr(args, "n_expert", 0) else 0
    memory = memory or probe_memory("cpu")
    cpu = not memory.separate_device  # CPU compute: experts are held prepared too
    sizes = {name: _memory_cost(t, precise, tied, cpu) for name, t in gguf.tensors.items()}
    return plan_residency(
        config,
        sizes,
        kv_bytes,
        memory,
        n_expert=getattr(args, "n_expert", 0) or 1,
        min_slots=getattr(args, "n_expert_used", 0) or 1,
        scratch_bytes=scratch,
    )


# Bytes per weight of the copy a CPU kernel strategy keeps next to the file's blocks (an upper
# bound: F32/F16 files may be used in place, but fused q/k/v and gate/up copies are not).
_PREPARED = {"dense_f32": 4.0, "dense_f16": 2.0, "dense_bf16": 2.0, "int4pack": 0.875}


def _memory_cost(info: "TensorInfo", precise: bool, tied: bool, cpu: bool = False) -> int:
    """Resident bytes of a tensor: its file bytes (mapped or read) plus the kernel's prepared
    copy for linear weights (and for experts computed on the CPU), plus a float32 copy for
    small tensors (norms, biases)."""
    n = info.range.nbytes
    numel = math.prod(info.shape)
    if expert_layer(info.name) is not None:
        if not cpu or precise:
            return n  # experts used straight from their blocks (device, or exact path)
        n_expert, rows, cols = info.shape
        return n + n_expert * prepared_expert_nbytes(info.qtype, rows, cols)
    if len(info.shape) == 1:
        return n + 4 * numel
    if info.name == "token_embd.weight" and not tied:
        return n  # looked up row by row, never multiplied
    rows, cols = math.prod(info.shape[:-1]), info.shape[-1]
    strategy = "dense_f32" if precise else choose_strategy(info.qtype, (rows, cols), "cpu")
    return n + int(_PREPARED.get(strategy, 0.0) * numel)


class _ReadCopies:
    """The GGUF as the loader sees it in `read` load mode: resident tensors come back as
    private pread copies instead of views of the mapping; disk-tier tensors stay views (never
    touched, so never resident)."""

    def __init__(self, gguf: "GGUFModel", plan: ResidencyPlan):
        self._gguf, self._plan = gguf, plan

    def __getattr__(self, name: str):
        return getattr(self._gguf, name)

    def weight(self, name: str) -> QuantWeight:
        w = self._gguf.weight(name)
        if self._plan.tiers.get(name) == "disk" or w.source is None:
            return w
        data = read_range(w.source).view(w.data.shape)
        return QuantWeight(data, w.qtype, w.shape, source=w.source)


def load_model(
    gguf: "GGUFModel", plan: ResidencyPlan, precise: bool = False, **loader_args
) -> nn.Module:
    """`build_model` under a residency plan; the model gets `residency_plan` and
    `expert_sources` (for counters: `expert_stats(model.expert_sources)`)."""
    from localllm.engine.loader import build_model  # the loader imports the families

    src = _ReadCopies(gguf, plan) if plan.load_mode == "read" else gguf
    # only experts leave the device: other host-tier tensors would need host compute paths
    off_device = {n for n, t in plan.tiers.items() if t != "device" and expert_layer(n) is not None}
    model = build_model(src, precise=precise, host_tensors=off_device, **loader_args)
    model.expert_sources = apply_residency(model, plan)
    model.residency_plan = plan
    return model


def load_planned(
    gguf: "GGUFModel",
    config: ResidencyConfig,
    precise: bool = False,
    device: str = "cpu",
    max_model_len: int | None = None,
) -> nn.Module:
    """Plan against measured free memory on `device`, log the plan's warnings, then load."""
    plan = plan_model(gguf, config, max_model_len, probe_memory(device), precise)
    for warning in plan.warnings:
        log.warning("residency: %s", warning)
    return load_model(gguf, plan, precise=precise, device=device)
