"""Batch metadata and the dense KV cache that model forwards receive explicitly.

Tokens of all sequences in a step are laid out flat ([T]); `BatchMeta` says which slice belongs to
which sequence, which KV-cache slot it uses and how long the sequence is after the step. Model files
never allocate caches: the runner (here `Generator`) owns `KVCache` and passes it in.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BatchMeta:
    """Per-step layout of a flat token batch (host-side ints: the CPU path loops over sequences)."""

    query_start: tuple[int, ...]  # B+1 offsets into the flat token axis
    slots: tuple[int, ...]  # KV-cache row of each sequence
    seq_lens: tuple[int, ...]  # tokens in each sequence's context after this step

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @staticmethod
    def single(num_new: int, seq_len: int, slot: int = 0) -> "BatchMeta":
        """One sequence that appends `num_new` tokens, reaching `seq_len` tokens in context."""
        return BatchMeta(query_start=(0, num_new), slots=(slot,), seq_lens=(seq_len,))


class KVCache:
    """Dense per-layer K/V tensors shaped [slots, kv_heads, max_len, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
    ):
        vd = v_head_dim or head_dim
        self.max_len = max_len
        self.k = [
            torch.zeros(num_slots, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.v = [
            torch.zeros(num_slots, num_kv_heads, max_len, vd, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
