"""Embeddings: inputs -> token ids -> hidden states -> one pooled (normalised) vector per input.

`Embedder.prepare` tokenizes and checks inputs without touching the device (any thread);
`EmbedJob.step` runs one batch of forwards and must run on the thread that owns the device, so
`AsyncEngine` interleaves job steps with generation steps. Encoders (`model.generates` False)
run their bidirectional `encode` on padded batches; decoders run their usual forward over a
scratch paged KV cache of their own, so the engine's cache and its requests are never touched.

Ranking (pooling "rank", cross-encoders with a classification head) rides the same path: a
`RankPair` becomes llama-server's pair prompt `[BOS] query [EOS] [SEP] document [EOS]` (each
special where the vocabulary's flags ask for it: `[CLS] q [SEP] d [SEP]` for BERT), the second
segment gets token type 1 as in transformers, and the output is the head's scores, not a vector.
"""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.layers.pooling import check_method, default_pooling, normalize, pool
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states

BLOCK = 16  # scratch KV block size (tokens)


RANK = "rank"  # the pooling name of a cross-encoder's scores (llama.cpp's pooling_type 4)


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    embedding: torch.Tensor  # float32 [dim] on the CPU (rank: [labels], the head's scores)
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RankPair:
    """A query and a document to score together with pooling "rank" (another pooling embeds
    the pair's prompt as one text)."""

    query: str
    document: str


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

    @property
    def can_rank(self) -> bool:
        """The model has a classification head: it scores pairs (pooling "rank")."""
        return getattr(self.model, "rank_head", None) is not None

    def pooling(self, requested: str | None) -> str:
        """The method to use: the one asked for, else the one the model's metadata names."""
        if requested == RANK:
            if not self.can_rank:
                raise ValueError(
                    "this model has no classification head (cls.* tensors): it cannot rank "
                    "pairs; rerank with embedding similarity instead"
                )
            return RANK
        if requested is not None:
            return check_method(requested)
        arch = self.meta.get("general.architecture")
        if self.can_rank and f"{arch}.pooling_type" not in self.meta:
            # llama.cpp's converter writes no pooling type for a cross-encoder: its head says it
            raise ValueError(
                "this model is a reranker (it has a classification head): it makes no "
                "embeddings; name a pooling to pool its hidden states anyway"
            )
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
            if isinstance(item, RankPair):
                out.append(self._pair(i, item, limit, truncate is not None))
                continue
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

    def _pair(self, i: int, pair: RankPair, limit: int, cut: bool) -> list[int]:
        """llama-server's rerank prompt of one pair; `cut`: shorten the document to fit."""
        if not isinstance(pair.query, str) or not isinstance(pair.document, str):
            raise ValueError(f"pair {i}: query and document must be strings")
        tok = self.tokenizer
        # plain text on both sides: a "[SEP]" written in a document is not a separator
        q = tok.encode(pair.query, add_special=False, parse_special=False)
        d = tok.encode(pair.document, add_special=False, parse_special=False)
        head, mid, tail = self._pair_specials()
        first = [*head, *q, *mid]
        n = len(first) + len(d) + len(tail)
        if n > limit:
            if not cut:
                raise ValueError(
                    f"pair {i} has {n} tokens, more than the {limit} this model takes at once "
                    "(ask for truncation to cut the document)"
                )
            room = limit - len(first) - len(tail)
            if room < 1:
                raise ValueError(
                    f"pair {i}: the query takes {len(first) + len(tail)} of the {limit} tokens, "
                    "leaving no room for the document"
                )
            d = d[:room]
        return [*first, *d, *tail]

    def _pair_specials(self) -> tuple[list[int], list[int], list[int]]:
        """(before the query, between query and document, after the document) as llama-server's
        `format_prompt_rerank` lays them out from the vocabulary's add_bos/add_eos/add_sep
        flags (llama.cpp's defaults where the file has none: WordPiece adds [CLS] and [SEP])."""
        meta, tok = self.meta, self.tokenizer
        wpm = meta.get("tokenizer.ggml.model") == "bert"

        def flag(key: str, default: bool) -> bool:
            return bool(meta.get(f"tokenizer.ggml.{key}", default))

        sep = meta.get("tokenizer.ggml.seperator_token_id", 102 if wpm else None)
        eos = tok.eos_id if tok.eos_id is not None else sep
        bos = [tok.bos_id] if flag("add_bos_token", wpm or tok.add_bos) else []
        end = [eos] if flag("add_eos_token", False) and eos is not None else []
        mid = [*end, sep] if flag("add_sep_token", wpm) and sep is not None else end
        return [t for t in bos if t is not None], mid, end

    def token_types(self, seq: list[int]) -> list[int]:
        """BERT's segments of a pair: 0 up to and including the first separator after the
        start (the tokenizer's EOS/[SEP]), 1 after it; all 0 when there is none."""
        seps = {self.tokenizer.eos_id, self.meta.get("tokenizer.ggml.seperator_token_id")}
        for j, t in enumerate(seq[1:], start=1):
            if t in seps:
                return [0] * (j + 1) + [1] * (len(seq) - j - 1)
        return [0] * len(seq)

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
    def hidden_states(self, seqs: list[list[int]], pairs: bool = False) -> list[torch.Tensor]:
        """Final (normed) hidden states [n_i, dim] of each sequence, in order. `pairs`: the
        sequences are query-document pairs (an encoder gives them `token_types`)."""
        if self.encoder:
            return self._encode(seqs, pairs)
        return self._decode(seqs)

    def _encode(self, seqs: list[list[int]], pairs: bool = False) -> list[torch.Tensor]:
        longest = max(map(len, seqs))
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros(len(seqs), longest, dtype=torch.bool)
        types = torch.zeros(len(seqs), longest, dtype=torch.long) if pairs else None
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = True
            if types is not None:
                types[b, : len(s)] = torch.tensor(self.token_types(s))
        dev = self.device
        types = None if types is None else types.to(dev)
        h = self.model.encode(ids.to(dev), mask.to(dev), types)
        return [h[b, : len(s)] for b, s in enumerate(seqs)]

    @torch.inference_mode()
    def scores(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        """The classification head over each sequence's first token: [n, labels] float32."""
        return self.model.rank_head(torch.stack([h[0] for h in hidden]).float())

    def _decode(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        lora = getattr(self.model, "lora", None)
        if lora is not None:  # embeddings run on the base: no row on an adapter (engine.lora)
            lora.set_rows([((), 0)])
        layers, kv_heads, head_dim = self.model.kv_shape()
        lens = [len(s) for s in seqs]
        nblocks = [-(-n // BLOCK) for n in lens]
        kv = PagedKVCache(
            layers, sum(nblocks), BLOCK, kv_heads, head_dim, dtype="f32", device=self.device
        )
        attach_states(kv, self.model, len(seqs))  # hybrids: one state slot per sequence
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
        rank = self._method == RANK
        hidden = self._embedder.hidden_states([self._seqs[i] for i in group], pairs=rank)
        if rank:  # scores as they come: a logit is never normalised
            scores = self._embedder.scores(hidden).cpu()
            for j, i in enumerate(group):
                self._out[i] = EmbeddingOutput(scores[j], len(self._seqs[i]))
            return
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
