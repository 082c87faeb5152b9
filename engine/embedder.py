"""Embeddings: inputs -> token ids -> hidden states -> one pooled (normalised) vector per input.

`Embedder.prepare` tokenizes and checks inputs without touching the device (any thread);
`EmbedJob.step` runs one batch of forwards and must run on the thread that owns the device, so
`AsyncEngine` interleaves job steps with generation steps. Encoders (`model.generates` False)
run their bidirectional `encode` on padded batches; decoders run their usual forward over a
scratch paged KV cache of their own, so the engine's cache and its requests are never touched.
"""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from localllm.engine.batch import BatchMeta
from localllm.engine.kv_cache import PagedKVCache
from localllm.engine.pooling import check_method, default_pooling, normalize, pool

BLOCK = 16  # scratch KV block size (tokens)


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    embedding: torch.Tensor  # float32 [dim] on the CPU
    prompt_tokens: int


class Embedder:
    """Embedding forwards for one loaded model.

    token_budget: tokens per forward (padded tokens for encoders); a decoder input longer than
    it is run in chunks, like a chunked prefill.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        meta: dict[str, Any],
        max_tokens: int,
        device: torch.device | str = "cpu",
        token_budget: int = 2048,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.meta = meta
        self.encoder = not getattr(model, "generates", True)
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.token_budget = max(token_budget, BLOCK)

    @property
    def dim(self) -> int:
        return self.model.args.dim

    def pooling(self, requested: str | None) -> str:
        """The method to use: the one asked for, else the one the model's metadata names."""
        if requested is not None:
            return check_method(requested)
        return default_pooling(self.meta, self.encoder)

    # -- inputs ---------------------------------------------------------------------------------

    def prepare(
        self, inputs: Sequence[str | Sequence[int]], truncate: int | None = None
    ) -> list[list[int]]:
        """Token ids of every input, checked. `truncate`: cut longer inputs to this many tokens
        (-1: the model's limit), keeping a trailing EOS/SEP the tokenizer added; None: error."""
        if isinstance(inputs, str) or not isinstance(inputs, Sequence) or not inputs:
            raise ValueError("input must be a non-empty list of texts or token-id lists")
        limit = self.max_tokens
        if truncate is not None:
            if truncate == 0 or truncate < -1:
                raise ValueError("truncate must be a positive token count or -1 (model limit)")
            limit = limit if truncate == -1 else min(truncate, limit)
        tok = self.tokenizer
        out = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"input {i} is an empty string")
                ids = tok.encode(item, add_special=True, parse_special=True)
                keep_last = tok.add_eos and ids[-1] == tok.eos_id
            else:
                ids = [int(t) for t in item]
                if not ids:
                    raise ValueError(f"input {i} is an empty token list")
                bad = [t for t in ids if not 0 <= t < self.model.args.vocab_size]
                if bad:
                    raise ValueError(
                        f"input {i} has token id {bad[0]} outside the vocabulary "
                        f"0..{self.model.args.vocab_size - 1}"
                    )
                keep_last = False
            if len(ids) > limit:
                if truncate is None:
                    raise ValueError(
                        f"input {i} has {len(ids)} tokens, more than the {limit} this model "
                        "embeds at once (ask for truncation to cut it)"
                    )
                ids = ids[: limit - 1] + ids[-1:] if keep_last and limit > 1 else ids[:limit]
            out.append(ids)
        return out

    def job(self, seqs: list[list[int]], pooling: str | None, norm: bool) -> "EmbedJob":
        return EmbedJob(self, seqs, self.pooling(pooling), norm)

    # -- forwards (device thread) ---------------------------------------------------------------

    def groups(self, seqs: list[list[int]]) -> list[list[int]]:
        """Indices of `seqs` batched by length within the token budget (one forward each)."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        groups: list[list[int]] = []
        used = 0
        for i in order:
            n = len(seqs[i])
            # Sorted ascending, so an encoder's padded size is the newest length times the count.
            cost = n * (len(groups[-1]) + 1) if self.encoder and groups else used + n
            if groups and cost <= self.token_budget:
                groups[-1].append(i)
                used = cost
            else:
                groups.append([i])
                used = n
        return groups

    @torch.inference_mode()
    def hidden_states(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Final (normed) hidden states [n_i, dim] of each sequence, in order."""
        if self.encoder:
            return self._encode(seqs)
        return self._decode(seqs)

    def _encode(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        longest = max(map(len, seqs))
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros(len(seqs), longest, dtype=torch.bool)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = True
        h = self.model.encode(ids.to(self.device), mask.to(self.device))
        return [h[b, : len(s)] for b, s in enumerate(seqs)]

    def _decode(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        layers, kv_heads, head_dim = self.model.kv_shape()
        lens = [len(s) for s in seqs]
        nblocks = [-(-n // BLOCK) for n in lens]
        kv = PagedKVCache(
            layers, sum(nblocks), BLOCK, kv_heads, head_dim, dtype="f32", device=self.device
        )
        tables, first = [], 0
        for nb in nblocks:
            tables.append(list(range(first, first + nb)))
            first += nb
        if len(seqs) > 1:  # a group of several fits the budget: one forward
            batch = self._batch(lens, lens, tables)
            ids = torch.tensor([t for s in seqs for t in s], device=self.device)
            pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)
            return list(self.model(ids, pos, batch, kv).split(lens))
        # One long input: chunks in order over the same scratch cache, as a chunked prefill.
        seq, parts = seqs[0], []
        for start in range(0, len(seq), self.token_budget):
            chunk = seq[start : start + self.token_budget]
            end = start + len(chunk)
            batch = self._batch([len(chunk)], [end], tables)
            ids = torch.tensor(chunk, device=self.device)
            parts.append(self.model(ids, torch.arange(start, end, device=self.device), batch, kv))
        return [torch.cat(parts)]

    def _batch(self, num_new: list[int], seq_lens: list[int], tables: list) -> BatchMeta:
        batch = BatchMeta.from_tables(num_new, seq_lens, tables, BLOCK)
        if self.device.type == "cpu":
            return batch
        return replace(batch, slot_mapping=batch.slot_mapping.to(self.device))  # next to the KV


class EmbedJob:
    """One embedding request: its batches run one `step()` at a time (on the device thread)."""

    def __init__(self, embedder: Embedder, seqs: list[list[int]], method: str, norm: bool):
        self._embedder = embedder
        self._seqs = seqs
        self._method, self._norm = method, norm
        self._pending = deque(embedder.groups(seqs))
        self._out: list[EmbeddingOutput | None] = [None] * len(seqs)

    @property
    def done(self) -> bool:
        return not self._pending

    def step(self) -> None:
        """Run the next batch."""
        group = self._pending.popleft()
        hidden = self._embedder.hidden_states([self._seqs[i] for i in group])
        for i, h in zip(group, hidden, strict=True):
            v = pool(h.float(), self._method)
            if self._norm:
                v = normalize(v)
            self._out[i] = EmbeddingOutput(v.cpu(), len(self._seqs[i]))

    def run(self) -> list[EmbeddingOutput]:
        """Every remaining batch, then the outputs in input order."""
        while self._pending:
            self.step()
        return self.outputs()

    def outputs(self) -> list[EmbeddingOutput]:
        if self._pending:
            raise RuntimeError("the embedding job has batches left to run")
        return list(self._out)
