"""Residency of MoE models: the plan of a GGUF from its header (`plan_model`) and loading under a
plan (`load_model`, `load_planned`), which then gives every MoE block its expert source
(`sources.apply_residency`: resident, host-computed, mapped, split or streamed from disk)."""

import dataclasses
import logging
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from localllm.engine.models import model_module
from localllm.engine.models.common import unused_tensor
from localllm.engine.moe.sources import apply_residency
from localllm.engine.runtime.recurrent_state import slot_pool_bytes, state_shapes
from localllm.kernels.cpu.native import load as load_native
from localllm.kernels.moe.prepared import prepared_expert_nbytes
from localllm.kernels.quant.linear import choose_strategy
from localllm.kernels.quant.linear_native import NATIVE_TYPES
from localllm.kernels.quant.repack import packs
from localllm.kernels.quant.types import QuantType
from localllm.kernels.quant.widen import widened_nbytes
from localllm.offload import QuantWeight
from localllm.offload.memory import MemoryInfo, probe_memory
from localllm.offload.plan import ResidencyPlan, expert_layer, plan_residency
from localllm.offload.reader import read_range
from localllm.offload.residency import ResidencyConfig, ResidencyError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from localllm.engine.gguf import GGUFModel
    from localllm.engine.gguf.model import TensorInfo

EMBEDDING = "token_embd.weight"  # read in place from host memory by a GPU where the plan says
PLAN_KV_TOKENS = 8192  # KV the plan reserves when no context length is given
PLAN_STATE_SEQS = 16  # hybrids: sequences whose state the plan holds (EngineArgs.max_num_seqs)
SCRATCH_TOKENS = 512  # tokens per step the scratch estimate allows for (the engine's default)
# Device memory of the CUDA context with torch's kernels loaded, which no torch figure counts:
# nvidia-smi read 783 MiB for a process holding 98 MiB of tensors (H200, torch 2.11, driver 580)
CUDA_CONTEXT = 685 << 20


def plan_model(
    gguf: "GGUFModel",
    config: ResidencyConfig,
    kv_tokens: int | None = None,
    memory: MemoryInfo | None = None,
    precise: bool = False,
    state_seqs: int = PLAN_STATE_SEQS,
) -> ResidencyPlan:
    """The residency plan of a GGUF model from its header alone (no weight is read).

    Tensor sizes are what holding them costs (see `_memory_cost`); KV is estimated in f16 for
    `kv_tokens` (default: the model's context, at most PLAN_KV_TOKENS; the engine sizes the
    real KV pool from what is free after loading). A hybrid model's recurrent state is counted
    exactly: one slot per sequence of `state_seqs` (the engine's --parallel) and its scratch slot.
    """
    embd = gguf.tensors.get("token_embd.weight")
    args = model_module(gguf.architecture or "").ModelArgs.from_gguf(
        gguf.metadata, embd.shape[0] if embd else 0
    )
    tokens = kv_tokens or min(args.context_length, PLAN_KV_TOKENS)
    kv_heads = getattr(args, "n_kv_heads", args.n_heads)  # encoders (bert) have no KV cache
    v_dim = getattr(args, "v_cache_dim", args.head_dim)  # deepseek2 caches a narrower V (latent)
    kv_layers = getattr(args, "kv_layers", args.n_layers)  # hybrids: their attention layers
    kv_bytes = kv_layers * kv_heads * (args.head_dim + v_dim) * 2 * tokens
    states = _state_bytes(gguf.architecture or "", args, state_seqs)
    tied = "output.weight" not in gguf.tensors
    # a prefill chunk's activations and logits, and up to three dequantized experts in flight
    expert_f32 = 3 * args.dim * getattr(args, "expert_hidden_dim", args.hidden_dim) * 4
    scratch = SCRATCH_TOKENS * (args.vocab_size + 8 * args.dim) * 4
    scratch += 3 * expert_f32 if getattr(args, "n_expert", 0) else 0
    memory = memory or probe_memory("cpu")
    scratch += _cublas_workspaces(memory)
    gpu = memory.device.startswith(("cuda", "mps"))  # (unified or not: it reads the blocks)
    cpu = not gpu  # CPU compute: experts are held prepared too ...
    native = load_native() if cpu and not precise else None
    raw = _native_layers(gguf, native)  # ... unless native
    cuda = memory.device.startswith("cuda")  # (packs some experts wider: `_memory_cost`)
    sizes = {
        n: _memory_cost(t, precise, tied, cpu and expert_layer(n) not in raw, native, gpu, cuda)
        for n, t in gguf.tensors.items()
        if not unused_tensor(args, n)  # never loaded (a NextN layer): costs nothing
    }
    rule = config.tier_of(EMBEDDING)
    if tied and memory.separate_device and rule is not None and rule.tier == "host":
        raise ResidencyError(
            "token_embd.weight is the output head too (the file has no output.weight): "
            "it stays on the device"
        )
    return plan_residency(
        config,
        sizes,
        kv_bytes,
        memory,
        n_expert=getattr(args, "n_expert", 0) or 1,
        min_slots=getattr(args, "n_expert_used", 0) or 1,
        scratch_bytes=scratch,
        host_cache=not precise and _host_cacheable(gguf, memory),
        # a given budget is the whole process's device memory (what nvidia-smi shows); measured
        # free memory is read with the context already made, so it is counted there once
        runtime_bytes=CUDA_CONTEXT if cuda and config.budget else 0,
        # an untied embedding table is read a row per token: the cheapest bytes to leave on host
        host_first=(EMBEDDING,) if cuda and memory.separate_device and not tied else (),
        state_bytes=states,
    )


def _state_bytes(arch: str, args, seqs: int) -> int:
    """What a hybrid's state slots for `seqs` sequences hold (0 for a model without state): its
    shapes as its `Model` declares them, the model built on the meta device (no memory)."""
    cls = model_module(arch).Model
    if not hasattr(cls, "state_shapes"):
        return 0
    with torch.device("meta"):
        shapes = state_shapes(cls(args))
    return slot_pool_bytes(shapes, seqs)


def _host_cacheable(gguf: "GGUFModel", memory: MemoryInfo) -> bool:
    """Whether a separate CUDA device's packed kernels take every layer's expert types (and
    sizes), so host-tier experts are read in place and can be cached in device slots."""
    if not (memory.separate_device and memory.device.startswith("cuda")):
        return False
    experts = [t for n, t in gguf.tensors.items() if expert_layer(n) is not None]
    if not experts or any(n.endswith("_exps.bias") for n in gguf.tensors):  # (gpt-oss)
        return False
    return all(packs(t.qtype, t.shape[-1]) for t in experts)


def _cublas_workspaces(memory: MemoryInfo) -> int:
    """Device memory torch's cuBLAS keeps per stream that runs a matmul (32 MiB on Hopper, 8 MiB
    + 128 KiB elsewhere: PyTorch's defaults), for the compute stream and a graph capture's
    (on unified memory too: they come out of its one pool)."""
    if not memory.device.startswith("cuda"):
        return 0
    if not torch.cuda.is_available():
        return 2 * (32 << 20)  # (a plan made without the device: the larger)
    major = torch.cuda.get_device_capability(torch.device(memory.device))[0]
    return 2 * ((32 << 20) if major == 9 else (8 << 20) + (128 << 10))


def _native_layers(gguf: "GGUFModel", native) -> set[int]:
    """Layers whose routed experts a CPU model computes with the native kernels (raw blocks,
    nothing prepared): the kernels loaded and take the layer's three types and sizes (experts
    with biases, gpt-oss's, never do)."""
    if native is None:
        return set()
    parts: dict[int, dict[str, TensorInfo]] = {}
    for name, t in gguf.tensors.items():
        layer = expert_layer(name)
        if layer is not None:
            parts.setdefault(layer, {})[name.split(".", 2)[2]] = t
    out = set()
    for layer, ts in parts.items():
        g, u, d = (ts.get(f"ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
        if g is None or u is None or d is None or "ffn_gate_exps.bias" in ts:
            continue
        if native.supports(g.qtype, u.qtype, d.qtype, g.shape[-1], g.shape[-2], "silu"):
            out.add(layer)
    return out


# Bytes per weight of the copy a CPU kernel strategy keeps next to the file's blocks (an upper
# bound: F32/F16 files may be used in place, but fused q/k/v and gate/up copies are not).
_PREPARED = {"dense_f32": 4.0, "dense_f16": 2.0, "dense_bf16": 2.0, "int4pack": 0.875}


def _memory_cost(
    info: "TensorInfo", precise: bool, tied: bool, cpu=False, native=None, gpu=False, widen=False
) -> int:
    """Resident bytes of a tensor: its file bytes (mapped or read) plus the kernel's prepared
    copy for linear weights (and for experts computed on the CPU), plus a float32 copy for
    small tensors (norms, biases). `native`: the CPU kernels that keep Q6_K / Q8_0 linears as
    blocks (at most one stacked copy of them, for fused q/k/v). `gpu`: a GPU computes the
    linears, from their blocks (or the same bytes re-laid out: `TritonLinear`). `widen`: a CUDA
    device packs Q4_0 / Q5_0 / IQ4_NL experts as Q8_0 blocks (`kernels.quant.widen`)."""
    n = info.range.nbytes if info.range is not None else info.nbytes  # (made at load)
    numel = math.prod(info.shape)
    if expert_layer(info.name) is not None:
        if widen and not cpu:
            return widened_nbytes(info.qtype, n)
        if not cpu or precise:
            return n  # experts used straight from their blocks (device, or exact path)
        n_expert, rows, cols = info.shape
        return n + n_expert * prepared_expert_nbytes(info.qtype, rows, cols)
    if len(info.shape) == 1:
        return n + 4 * numel
    if gpu or (info.name == "token_embd.weight" and not tied):
        return n  # (an untied embedding is looked up row by row, never multiplied)
    rows, cols = math.prod(info.shape[:-1]), info.shape[-1]
    strategy = "dense_f32" if precise else choose_strategy(info.qtype, (rows, cols), "cpu")
    if native is not None and strategy == "dense_f16" and QuantType(info.qtype) in NATIVE_TYPES:
        return 2 * n
    return n + int(_PREPARED.get(strategy, 0.0) * numel)


class _ReadCopies:
    """The GGUF as the loader sees it in `read` load mode: resident tensors come back as
    private pread copies instead of views of the mapping; disk-tier tensors stay views (never
    touched, so never resident)."""

    # private copies cost host memory while held: the loader uploads experts' at once and holds
    # only linears' until their kernels are made (`build_model`)
    views = False

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
    # experts leave the device, and the embedding table on a separate GPU (mapped, a row read per
    # token); other host-tier tensors would need host compute paths
    off_device = {n for n, t in plan.tiers.items() if t != "device" and expert_layer(n) is not None}
    device = torch.device(loader_args.get("device", "cpu"))
    mapped = device.type == "cuda" and plan.memory.separate_device
    if mapped and plan.tiers.get(EMBEDDING) == "host":
        off_device.add(EMBEDDING)
    disk = [n for n, t in plan.tiers.items() if t == "disk"]
    if disk and hasattr(gguf, "place_on_disk"):  # a Hugging Face folder: tensors it makes at
        gguf.place_on_disk(disk)  # load are streamed from a file written once (engine/hf/spill)
    model = build_model(src, precise=precise, host_tensors=off_device, **loader_args)
    if EMBEDDING in off_device:
        _map_embedding(model, device)
    model.expert_sources = apply_residency(model, plan)
    model.residency_plan = plan
    if plan.memory.separate_device and torch.cuda.is_available():
        # the load's transients (stacked and packed copies) go back to the device, not to
        # torch's cache: the process holds what the plan counts
        torch.cuda.empty_cache()
    return model


def _map_embedding(model: nn.Module, device: torch.device) -> None:
    """The embedding table's host blocks into page-locked host memory that `device` reads in
    place (`offload.mapped`): a lookup gathers its rows over the bus, inside the decode graph."""
    from localllm.offload.mapped import map_tensors

    embd = model.get_submodule("token_embd")
    w = embd.weight
    embd.weight = dataclasses.replace(w, data=map_tensors({"rows": w.data}, device)["rows"])


def load_planned(
    gguf: "GGUFModel",
    config: ResidencyConfig,
    precise: bool = False,
    device: str = "cpu",
    max_model_len: int | None = None,
    max_num_seqs: int = PLAN_STATE_SEQS,
) -> nn.Module:
    """Plan against measured free memory on `device`, log the plan's warnings, then load."""
    plan = plan_model(gguf, config, max_model_len, probe_memory(device), precise, max_num_seqs)
    for warning in plan.warnings:
        log.warning("residency: %s", warning)
    return load_model(gguf, plan, precise=precise, device=device)
