"""Which attention heads the CUDA device-context kernel takes, known without triton.

`triton_prefill.flash_prefill_paged` reads a prompt chunk's blocks through a device table (what a
prompt CUDA graph replays for any context) for key / value heads that are powers of two of at least
16 (tensor-core tiles). Other heads take `paged.context_attention`'s host reads, which no CUDA
graph can capture: `engine.runtime.prefill_graphs.declined` keeps such models' prompts eager.
"""


def context_heads(d: int, dv: int) -> bool:
    """Whether the device-context kernel takes key / value heads of d / dv."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (d, dv))
