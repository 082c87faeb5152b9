"""Tiny random-weight hybrid GGUFs whose prompts a CUDA graph can take: head dims of 64 (the
device-context attention kernel's; the converted fixtures' 8 are not) and Q4_K experts (packed on
a GPU; the fixtures' F16 experts are not, so their routing reaches the host). Written by
`tests/perf/make_hybrid_synthetic.py`'s writer (qwen3next: `make_qwen3next.py`'s, its TINY shape)
with a byte tokenizer, vocabulary 512."""

from pathlib import Path

VOCAB = 512
MAMBA = {"d_inner": 512, "ssm_heads": 8, "d_state": 16}
MOE = {"n_expert": 4, "n_used": 2, "shared": 256}
# name -> (arch, extra shape fields)
KINDS = {
    "tiny-lfm2": ("lfm2", {}),
    # layer 0 dense (512), then 4 experts (top 2) of 256 with sigmoid routing and a choice bias
    "tiny-lfm2moe": ("lfm2moe", {"n_expert": 4, "n_used": 2, "n_dense": 1, "expert_ff": 256}),
    "tiny-granitehybrid": ("granitehybrid", {**MAMBA, **MOE}),
    # (`shared` is read even without experts: any size, unused)
    "tiny-granitehybrid_dense": ("granitehybrid", {**MAMBA, "shared": 512}),
    "tiny-qwen3next": ("qwen3next", {}),  # 3 DeltaNet layers, attention at 3, 8 experts top-2
}


def write_tiny_hybrid(root: Path, name: str) -> Path:
    """3 layers (attention at 1), dim 256, 4 / 2 heads of 64, FFN (or each expert) 256 or 512;
    qwen3next: 4 layers (attention at 3), dim 256, 4 / 2 heads of 64, 2 / 4 DeltaNet heads."""
    from tests.perf.make_hybrid_synthetic import Hybrid, write_hybrid

    arch, extra = KINDS[name]
    if arch == "qwen3next":
        import dataclasses

        from tests.perf.make_qwen3next import TINY, write

        p = root / f"{name}.gguf"
        write(p, dataclasses.replace(TINY, vocab=VOCAB), "Q4_K_M", None, seed=2)
        return p
    hidden = 256 if "n_expert" in extra and arch != "lfm2moe" else 512
    p = root / f"{name}.gguf"
    write_hybrid(p, Hybrid(arch, 3, (1,), 256, 4, 2, hidden, VOCAB, **extra), None, seed=2)
    return p
