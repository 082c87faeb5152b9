"""Engine flags shared by the commands that load a model (`run`, `serve`): one spelling, one
mapping to `EngineArgs` fields."""

import argparse
from typing import Any

from localllm.app.residency_flags import add_residency_flags, residency_config
from localllm.app.threads import add_threads_flag, apply_threads
from localllm.offload.residency import ResidencyConfig

KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "fp8")
# tokens a step takes by default (`-b`): on a GPU a 2,048-token prompt chunk beside the decoders
# served 1.09-1.41x the streams' tokens of 512 on an H100 (16 / 64 streams, 8B Q4_K_M,
# tests/perf/results/server.md, 2026-12-07), its p99 inter-token gap longer (65-80 / 123-145
# against 54 / 81 ms); on a CPU a chunk that long stalls the decoders for seconds
GPU_BATCH, CPU_BATCH = 2048, 512
# `--quantize` (engine.hf.checkpoint.STORE_TYPES; kept here so --help never imports torch)
QUANTIZE_CHOICES = ("q8_0", "q4_k", "q4_0", "q4_1", "q5_0", "q5_1", "f16", "bf16", "f32")


def add_engine_flags(p: argparse.ArgumentParser, *, parallel: int | None = None) -> None:
    """Context, KV storage, n-gram drafts, precise mode; `-np/--parallel` when `parallel` is set."""
    g = p.add_argument_group("engine")
    g.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (model's)")
    add_threads_flag(g)
    if parallel is not None:
        g.add_argument(
            "-np", "--parallel", type=int, default=parallel, help=f"sequences per step ({parallel})"
        )
        g.add_argument(
            "-b",
            "--batch-size",
            type=int,
            default=None,
            help=f"tokens per step, prompt chunks included ({GPU_BATCH} on a GPU, {CPU_BATCH} "
            "on a CPU)",
        )
    g.add_argument(
        "--cache-type", default="f16", choices=KV_CACHE_TYPES, help="KV cache storage (f16)"
    )
    g.add_argument("--draft", type=int, default=0, help="n-gram draft tokens per step (0: off)")
    g.add_argument("--precise", action="store_true", help="float32 reference matmuls (slower)")
    g.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default=None,
        help="a Hugging Face folder's weights made this type at load (default: as stored)",
    )
    g.add_argument(
        "--device", default="cpu", help="cpu, or cuda[:N]: weights stay quantized on the GPU"
    )
    g.add_argument(
        "--lora",
        action="append",
        metavar="PATH[:SCALE]",
        default=[],
        help="a LoRA adapter (PEFT folder or llama.cpp LoRA GGUF) applied unmerged at SCALE "
        "(1.0); repeatable, ids 0, 1, ... in order",
    )
    add_residency_flags(p)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineArgs` keywords from the flags above, checked by `EngineArgs` itself now, so a bad
    value (`-c 0`) fails before any model is opened or announced; torch's CPU threads are set
    here too (`-t`, or the cores free now)."""
    from localllm.engine import EngineArgs

    apply_threads(args)
    kw: dict[str, Any] = {
        "precise": args.precise,
        "max_model_len": args.ctx_size,
        "kv_cache_dtype": args.cache_type,
        "num_speculative_tokens": args.draft,
        "device": getattr(args, "device", "cpu"),
        "quantize": getattr(args, "quantize", None),
    }
    if getattr(args, "lora", None):
        from localllm.engine.lora import LoraSpec

        kw["lora"] = tuple(LoraSpec.parse(s) for s in args.lora)
    if getattr(args, "parallel", None) is not None:
        kw["max_num_seqs"] = args.parallel
        gpu = kw["device"].startswith("cuda")
        default = GPU_BATCH if gpu else CPU_BATCH
        kw["max_num_batched_tokens"] = default if args.batch_size is None else args.batch_size
    residency = residency_config(args)
    if residency != ResidencyConfig():  # planned loading only when asked for
        kw["residency"] = residency
    EngineArgs(**kw)
    return kw
