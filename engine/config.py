"""Engine knobs (vLLM's engine-argument names where one exists) and KV-cache sizing."""

from dataclasses import dataclass

from localllm.offload.residency import ResidencyConfig

KV_DTYPES = ("f32", "f16", "bf16", "q8_0", "fp8")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class EngineArgs:
    precise: bool = False  # exact fp32 matmuls everywhere (the reference path)
    max_model_len: int | None = None  # None: the model's context, capped by KV memory
    max_num_seqs: int = 16  # requests in one step
    max_num_batched_tokens: int = 512  # tokens in one step (prefill chunk size)
    block_size: int = 16  # tokens per KV block
    kv_cache_dtype: str = "f16"  # f32, f16, bf16, or 8-bit q8_0 / fp8
    kv_cache_memory: int | None = None  # bytes for KV blocks; None: sized from free memory
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = 0  # n-gram (prompt lookup) drafts per step; 0 turns it off
    ngram_max: int = 4  # longest suffix the proposer looks up
    ngram_min: int = 1  # shortest
    device: str = "cpu"  # "cuda": weights (still quantized), KV and batch metadata on the GPU
    residency: ResidencyConfig | None = None  # tiers / expert streaming; None: all resident
    quantize: str | None = None  # a Hugging Face folder's weights made this ggml type at load
    lora: tuple = ()  # `engine.lora.LoraSpec`s: adapters applied unmerged, ids in this order

    def __post_init__(self):
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)} (cuda:N allowed)")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.num_speculative_tokens < 0 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need num_speculative_tokens >= 0 and 1 <= ngram_min <= ngram_max")


@dataclass(frozen=True, slots=True)
class KVPlan:
    num_blocks: int
    max_model_len: int
    bytes_per_block: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_kv(args: EngineArgs, model_context: int, bytes_per_block: int, available: int) -> KVPlan:
    """Blocks for the KV pool: one full context or 1,024 tokens per sequence, whichever is more,
    within a quarter of free memory; never less than one full context unless that does not fit
    in half of free memory, and then the context shrinks."""
    bs = args.block_size
    max_len = min(args.max_model_len or model_context, model_context)
    if args.kv_cache_memory is not None:
        blocks = args.kv_cache_memory // bytes_per_block
    else:
        want = -(-max(max_len, args.max_num_seqs * 1024) // bs)
        blocks = min(want, max(available // 4, 0) // bytes_per_block)
        blocks = max(blocks, min(-(-max_len // bs), (available // 2) // bytes_per_block))
    if blocks < 2:
        raise ValueError(
            f"KV cache memory allows only {blocks} blocks of {bs} tokens "
            f"({bytes_per_block} bytes each); give kv_cache_memory or free memory"
        )
    return KVPlan(blocks, min(max_len, blocks * bs), bytes_per_block)
