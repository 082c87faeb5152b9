"""One-request text generation over a paged KV cache: load a GGUF, prefill, decode, stream ids.

This is the Foundation runner: it owns the KV cache (one sequence, one contiguous block table) and
the model and runs on the CPU. The batched engine of DESIGN §3 replaces its loop; the model
interface (`ids, positions, batch, kv`) already has that engine's shape.
"""

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import GGUFModel, open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states
from localllm.engine.sampling.params import SamplingParams
from localllm.engine.sampling.sampler import Sampler, SamplingRow
from localllm.engine.tokenizer import Tokenizer
from localllm.kernels.quant.linear_native import prompt_rows

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activation memory on long prompts
KV_BLOCK = 16  # tokens per KV block; one sequence's blocks are consecutive, read as a view


@dataclass(frozen=True, slots=True)
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    finish_reason: str  # "stop" (end-of-generation token), "length" (budget or context)
    stop_token: int | None  # the end-of-generation token that stopped it, if any


class Generator:
    """A loaded model plus tokenizer that generates for one sequence at a time."""

    def __init__(
        self,
        gguf: GGUFModel,
        model: nn.Module,
        tokenizer: Tokenizer,
        load_seconds: float,
        kv_dtype: str = "f32",
    ):
        self.gguf, self.model, self.tokenizer = gguf, model, tokenizer
        self.load_seconds = load_seconds
        # f32 by default: the greedy goldens and accuracy figures were recorded with f32 KV.
        self.kv_dtype = kv_dtype
        self.context_length = model.args.context_length
        self.last_stats: GenerationStats | None = None

    @classmethod
    def load(cls, path: str, precise: bool = False, kv_dtype: str = "f32") -> "Generator":
        """Open `path` (a .gguf, or any shard of a split model) and build model and tokenizer.

        `precise=True` keeps every matmul in float32 (the reference path used by tests);
        `kv_dtype` is the KV cache format ("f32", "f16", "bf16", "q8_0", "fp8").
        """
        t0 = time.perf_counter()
        gguf = open_gguf(path)
        try:
            model = build_model(gguf, precise=precise)
            tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        except BaseException:
            gguf.close()
            raise
        return cls(gguf, model, tokenizer, time.perf_counter() - t0, kv_dtype)

    def close(self) -> None:
        self.gguf.close()

    def _cache(self, max_len: int) -> PagedKVCache:
        layers, kv_heads, head_dim = self.model.kv_shape()
        blocks = -(-max_len // KV_BLOCK)
        vd = self.model.kv_value_dim()
        kv = PagedKVCache(
            layers, blocks, KV_BLOCK, kv_heads, head_dim, dtype=self.kv_dtype, v_head_dim=vd
        )
        attach_states(kv, self.model, 1)  # hybrid models: the one sequence's recurrent state
        return kv

    def _forward(self, ids: Sequence[int], start: int, kv: PagedKVCache,
                 prompt: bool = True) -> torch.Tensor:  # fmt: skip
        """Hidden states for `ids` placed at positions start.. of the one sequence (blocks 0..),
        as prompt rows or (`prompt` False) a decode row."""
        t = len(ids)
        positions = torch.arange(start, start + t)
        batch = BatchMeta.contiguous(t, start + t, KV_BLOCK, prompt=prompt)
        with prompt_rows(batch.prompt_mask()):
            return self.model(torch.tensor(ids, dtype=torch.long), positions, batch, kv)

    def score(self, ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits [len(ids), vocab]: row t predicts token t+1."""
        return torch.cat(list(self.score_blocks(ids)))

    @torch.inference_mode()
    def score_blocks(
        self, ids: Sequence[int], chunk: int = PREFILL_CHUNK
    ) -> Iterator[torch.Tensor]:
        """`score` one prefill chunk at a time (a 262k vocabulary makes full logits huge)."""
        kv = self._cache(len(ids))
        for s in range(0, len(ids), chunk):
            yield self.model.logits(self._forward(ids[s : s + chunk], s, kv))

    @torch.inference_mode()
    def stream(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated ids until max_tokens, an end-of-generation token or the context ends."""
        if not prompt:
            raise ValueError("the prompt is empty (no tokens to condition on)")
        if len(prompt) >= self.context_length:
            raise ValueError(
                f"prompt of {len(prompt)} tokens does not fit the context of {self.context_length}"
            )
        budget = self.context_length - len(prompt)
        if params.max_tokens is not None:
            budget = min(budget, params.max_tokens)
        kv = self._cache(len(prompt) + budget)
        sampler, out = Sampler(), []
        rng = None
        if not params.greedy:
            rng = torch.Generator()
            if params.seed is None:
                rng.seed()
            else:
                rng.manual_seed(params.seed)
        eog = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eog_ids)
        row = SamplingRow(params, rng, prompt, out, eog)
        t0 = time.perf_counter()
        for s in range(0, len(prompt), PREFILL_CHUNK):
            hidden = self._forward(prompt[s : s + PREFILL_CHUNK], s, kv)
        logits = self.model.logits(hidden[-1:])[0]
        t1 = time.perf_counter()
        n, stop = 0, None
        try:
            while n < budget:
                token = sampler(logits[None], [row])[0].token_id
                out.append(token)
                if token in eog or token in params.stop_token_ids:
                    stop = token
                    break
                n += 1
                yield token
                if n == budget:
                    break
                pos = len(prompt) + n - 1
                logits = self.model.logits(self._forward([token], pos, kv, prompt=False))[0]
        finally:
            t2 = time.perf_counter()
            reason = "stop" if stop is not None else "length"
            self.last_stats = GenerationStats(len(prompt), n, t1 - t0, t2 - t1, reason, stop)
