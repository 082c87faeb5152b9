"""Batch metadata that model forwards receive explicitly: flat tokens laid over the KV pages.

Tokens of all sequences in a step are laid out flat ([T]); `BatchMeta` says which slice belongs to
which sequence, which blocks of the paged KV cache hold its context, in which cache slot each new
token's k/v goes and how long each sequence is after the step. The new tokens of a sequence are its
last ones. Model files never allocate caches: the runner owns the `PagedKVCache` and passes it in.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True, eq=False)
class BatchMeta:
    """Per-step layout of a flat token batch (host-side ints: the CPU path loops over sequences)."""

    query_start: tuple[int, ...]  # B+1 offsets into the flat token axis
    seq_lens: tuple[int, ...]  # each sequence's context length after this step
    block_tables: tuple[tuple[int, ...], ...]  # each sequence's KV block ids, in order
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    block_size: int
    # Per-step memo for attention backends (e.g. the batched decode gather plan, keyed by window):
    # built on first use by one layer, reused by the others; it lives and dies with this step.
    plans: dict = field(default_factory=dict, repr=False)
    # One sequence whose block table [W] and (first new position, length after the step) [2]
    # are int64 tensors on the device: attention reads its context through them alone, so a
    # captured prompt graph replays for any context. Its host table is then empty and its host
    # length is the step's token count (padding included).
    context: tuple[torch.Tensor, torch.Tensor] | None = None
    # Multimodal embeddings (`engine.multimodal`): flat rows [R] int64 and their vectors [R, dim]
    # that replace those rows' token embeddings (an image's placeholders), or None.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # Recurrent-state models: each sequence's state slot (`engine.runtime.recurrent_state`);
    # empty: slots 0..B-1 (one-off callers that own the whole state)
    state_slots: tuple[int, ...] = ()
    # Each sequence's rows this step are prompt rows (True) or decode rows: a step that starts
    # inside the prompt (a prefill chunk, the tail recomputed after a prefix-cache hit, a resumed
    # request's recompute) computes prompt rows, one that starts past it (a decode token, draft
    # verification) decode rows. On the CPU prompt rows take the prompt path whatever their
    # count and decode rows the decode path (`prompt_mask`); empty: every row is a decode row.
    prompt: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        b = len(self.seq_lens)
        if len(self.query_start) != b + 1 or len(self.block_tables) != b:
            raise ValueError("query_start needs B+1 offsets and block_tables B tables")
        if self.prompt and len(self.prompt) != b:
            raise ValueError(f"prompt has {len(self.prompt)} flags for {b} sequences")
        if self.slot_mapping.shape != (self.query_start[-1],):
            raise ValueError(
                f"slot_mapping has shape {tuple(self.slot_mapping.shape)}, "
                f"expected ({self.query_start[-1]},)"
            )
        if self.context is not None:
            if b != 1 or self.seq_lens[0] != self.query_start[-1] or self.block_tables[0]:
                raise ValueError("a device context is one sequence, its host table empty")
            return
        for i, (n, table) in enumerate(zip(self.seq_lens, self.block_tables, strict=True)):
            if len(table) * self.block_size < n:
                raise ValueError(f"sequence {i}: {len(table)} blocks cannot hold {n} tokens")

    def splice(self, x: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, dim] with the multimodal rows put in place (`embeds`)."""
        if self.embeds is None:
            return x
        rows, values = self.embeds
        return x.index_copy(0, rows, values.to(x.dtype))

    def embed_runs(self) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        """Per sequence, the position ranges [a, b) of its consecutive multimodal rows this step
        (one per image for a model whose image tokens are one run), or None without any."""
        if self.embeds is None:
            return None
        if "embed_runs" not in self.plans:  # one host read per step, shared by every layer
            rows = sorted(self.embeds[0].tolist())
            runs: list[list[tuple[int, int]]] = [[] for _ in self.seq_lens]
            b = 0
            for r in rows:
                while r >= self.query_start[b + 1]:
                    b += 1
                pos = self.seq_lens[b] - (self.query_start[b + 1] - r)
                seq = runs[b]
                if seq and seq[-1][1] == pos:
                    seq[-1] = (seq[-1][0], pos + 1)
                else:
                    seq.append((pos, pos + 1))
            self.plans["embed_runs"] = tuple(tuple(s) for s in runs)
        return self.plans["embed_runs"]

    def prompt_mask(self) -> "bool | torch.Tensor":
        """The step's prompt rows (`prompt`): False (none), True (all) or a bool [T] over the
        flat rows."""
        if not any(self.prompt):
            return False
        if all(self.prompt):
            return True
        qs = self.query_start
        return torch.tensor([p for b, p in enumerate(self.prompt)
                             for _ in range(qs[b + 1] - qs[b])], dtype=torch.bool)  # fmt: skip

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @staticmethod
    def contiguous(
        num_new: int, seq_len: int, block_size: int, first_block: int = 0, prompt: bool = False
    ) -> "BatchMeta":
        """One sequence whose blocks are first_block, first_block+1, ..., appending `num_new`
        tokens to reach `seq_len` in context (`prompt`: as prompt rows)."""
        table = tuple(range(first_block, first_block - (-seq_len // block_size)))
        base = first_block * block_size
        slots = torch.arange(base + seq_len - num_new, base + seq_len)
        return BatchMeta((0, num_new), (seq_len,), (table,), slots, block_size,
                         prompt=(True,) if prompt else ())  # fmt: skip

    @staticmethod
    def from_tables(
        num_new: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
    ) -> "BatchMeta":
        """Several sequences: sequence b appends num_new[b] tokens to reach seq_lens[b]; the slot
        mapping follows from its block table."""
        starts, slots = [0], []
        for t, n, table in zip(num_new, seq_lens, block_tables, strict=True):
            starts.append(starts[-1] + t)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(n - t, n)]
        return BatchMeta(
            tuple(starts),
            tuple(seq_lens),
            tuple(tuple(t) for t in block_tables),
            torch.tensor(slots, dtype=torch.long),
            block_size,
        )
