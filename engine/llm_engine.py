"""The engine: requests in, one step at a time, outputs out (DESIGN §3).

`step()` is the whole loop body: schedule -> run the model -> update the requests -> detokenize.
It is synchronous and single-threaded on purpose; `AsyncEngine` runs it on the one thread that
owns the device, `LLM` runs it inline.
"""

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from localllm.engine.config import EngineArgs, plan_kv
from localllm.engine.core.kv_manager import KVCacheManager
from localllm.engine.core.output_processor import PromptGroup, RequestState
from localllm.engine.core.outputs import RequestOutput
from localllm.engine.core.request import Request
from localllm.engine.core.scheduler import Scheduler, SchedulerConfig
from localllm.engine.embedder import Embedder, EmbeddingOutput, EmbedJob, RankPair
from localllm.engine.hf import HFCheckpoint
from localllm.engine.loader import (
    build_model,
    load_tokenizer,
    model_args,
    open_weights,
)
from localllm.engine.lora import LoraSet, attach_adapters
from localllm.engine.moe.residency import load_planned
from localllm.engine.multimodal import MultiModalInput, check_inputs
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import RecurrentState, state_shapes
from localllm.engine.runtime.runner import ModelRunner
from localllm.engine.sampling.ngram import NgramProposer
from localllm.engine.sampling.params import SamplingParams
from localllm.engine.sampling.structured import GrammarCompiler
from localllm.engine.tokenizer import ChatTemplate
from localllm.engine.tokenizer.continuation import continued_render
from localllm.kernels.cpu.malloc_tuning import release_free_memory
from localllm.offload.memory import available_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    text: str | None  # the prompt as given, when it was text
    ids: list[int]
    params: SamplingParams
    grammar: Any  # a compiled `engine.sampling.structured.Grammar`, or None
    mm_inputs: tuple[MultiModalInput, ...] = ()  # images: placeholders + embeddings


class LLMEngine:
    def __init__(self, model: str, args: EngineArgs | None = None):
        args = args or EngineArgs()
        self.args = args
        t0 = time.perf_counter()
        # a GGUF, or a Hugging Face folder read as one (`engine.hf`)
        self.gguf = open_weights(model, args.quantize)
        try:
            # the whole header is checked before anything is built from it: hyperparameters
            # against the tensors, then the vocabulary (a hostile file fails here, in milliseconds)
            model_args(self.gguf)
            self.tokenizer = load_tokenizer(self.gguf)
            if args.residency is None:
                self.model = build_model(self.gguf, precise=args.precise, device=args.device)
            else:  # planned from the header: a model that cannot fit fails before any read
                self.model = load_planned(
                    self.gguf, args.residency, args.precise, args.device, args.max_model_len,
                    args.max_num_seqs,
                )  # fmt: skip
            # LoRA adapters hang beside the built linears, checked against them (engine.lora)
            rows = max(args.max_num_batched_tokens, 512)
            self.loras: LoraSet | None = (
                attach_adapters(self.model, args.lora, self.gguf, args.device, rows)
                if args.lora
                else None
            )
        except BaseException:
            self.gguf.close()
            raise
        if isinstance(self.gguf, HFCheckpoint):
            # the shards stay mapped only while a weight views them: with --quantize none does,
            # and the float pages read to make the blocks leave the process's memory
            self.gguf.close()
        self.vocab_size = self.model.args.vocab_size
        # Encoder-only models (BERT) make embeddings and never generate.
        self.generates = getattr(self.model, "generates", True)
        layers, kv_heads, head_dim = self.model.kv_shape()
        vd = self.model.kv_value_dim()
        dtype = "f32" if args.precise and args.kv_cache_dtype == "f16" else args.kv_cache_dtype
        per_block = PagedKVCache.bytes_per_block(
            layers, args.block_size, kv_heads, head_dim, dtype, vd
        )
        # hybrid models: one recurrent-state slot per running sequence, allocated before the KV
        # is sized from what is free
        shapes = state_shapes(self.model)
        if shapes and args.num_speculative_tokens:
            raise ValueError(
                f"{self.model.args.arch} keeps recurrent state, which cannot roll back rejected "
                "drafts: speculative decoding is not available for it"
            )
        states = RecurrentState(shapes, args.max_num_seqs, args.device) if shapes else None
        free = available_bytes(args.device)  # measured after the weights are on the device
        ctx = self.model.args.context_length
        # An encoder keeps no KV cache: two blocks keep the (idle) scheduler well-formed.
        kv_args = args if self.generates else replace(args, kv_cache_memory=2 * per_block)
        budgeted = getattr(self.model, "residency_plan", None)
        if budgeted is not None and budgeted.budget_source == "given" and self.generates:
            # a given memory budget holds the KV its plan reserved, not a share of what is free
            reserved = max(budgeted.kv_bytes, 2 * per_block)
            kv_args = replace(kv_args, kv_cache_memory=args.kv_cache_memory or reserved)
        plan = plan_kv(kv_args, ctx, per_block, free)
        self.kv_plan = plan
        self.max_model_len = plan.max_model_len
        if not self.generates:
            self.max_model_len = min(args.max_model_len or ctx, ctx)
        # one block more than the plan on a GPU: its slots take prompt graphs' padding
        spare = 1 if torch.device(args.device).type == "cuda" else 0
        self.kv_cache = PagedKVCache(
            layers, plan.num_blocks + spare, args.block_size, kv_heads, head_dim, dtype,
            args.device, vd,
        )  # fmt: skip
        self.kv_cache.states = states
        self.kv_manager = KVCacheManager(
            args.block_size, plan.num_blocks, enable_caching=args.enable_prefix_caching,
            state_slots=args.max_num_seqs if states is not None else 0,
        )  # fmt: skip
        # decode steps launched one ahead on a GPU (off where n-gram drafts change the next step)
        ahead = torch.device(args.device).type == "cuda" and not args.num_speculative_tokens
        config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            lookahead_slots=int(ahead),
            whole_mm_spans=getattr(self.model, "bidirectional_mm", False),
        )
        self.scheduler = Scheduler(config, self.kv_manager)
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.kv_manager.get_block_ids,
            spare_slot=plan.num_blocks * args.block_size if spare else None,
            max_blocks=-(-self.max_model_len // args.block_size),
            decode_ahead=ahead, state_slot=self.kv_manager.get_state_slot,
        )  # fmt: skip
        self.proposer = (
            NgramProposer(args.num_speculative_tokens, args.ngram_max, args.ngram_min)
            if args.num_speculative_tokens
            else None
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        self.groups: dict[str, PromptGroup] = {}
        self.states: dict[str, RequestState] = {}  # child request id -> its text state
        self._ids = itertools.count()
        self._chat_template: ChatTemplate | None = None
        device = self.kv_cache.k[0].device
        budget = max(args.max_num_batched_tokens, 512)
        self.embedder = Embedder(
            self.model, self.tokenizer, self.gguf.metadata, self.max_model_len, device, budget
        )
        self.load_seconds = time.perf_counter() - t0

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special=True, parse_special=True)
        return list(prompt)

    def prepare(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        mm_inputs: Sequence[MultiModalInput] = (),
    ) -> "PreparedRequest":
        """Tokenize, check and compile a request's grammar without touching engine state, so
        callers on other threads can do this work (and get its errors) off the engine thread.

        `mm_inputs` (`engine.multimodal`): embeddings that replace the prompt's placeholder
        tokens (images), in prompt order."""
        params = params or SamplingParams()
        self._check_generates()
        ids = self.tokenize(prompt)
        self._validate(ids, params)
        if mm_inputs:
            if not getattr(self.model, "takes_embeds", False):
                raise ValueError(f"{self.model.args.arch} models do not take image embeddings")
            check_inputs(mm_inputs, len(ids), self.model.args.dim)
        grammar = self.grammars.compile(params.structured) if params.structured else None
        text = prompt if isinstance(prompt, str) else None
        return PreparedRequest(text, ids, params, grammar, tuple(mm_inputs))

    def add_request(
        self,
        request_id: str | None,
        prompt: "str | Sequence[int] | PreparedRequest",
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        delta: bool = False,
        arrival_time: float | None = None,
        mm_inputs: Sequence[MultiModalInput] = (),
    ) -> str:
        """Queue a request; every check happens here (or in `prepare`), before any decoding.

        `prompt` may be a `PreparedRequest` from `prepare` (then `params` and `mm_inputs` are
        ignored).
        """
        if not isinstance(prompt, PreparedRequest):
            prompt = self.prepare(prompt, params, mm_inputs)
        ids, params, grammar = prompt.ids, prompt.params, prompt.grammar
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        lora = self._lora(params)
        if lora:  # other adapters, other KV: never shared through the prefix cache
            cache_salt = f"{cache_salt or ''}\x00lora={lora}"
        states = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                rid,
                ids,
                params,
                eos_ids=frozenset(self.tokenizer.eog_ids),
                max_tokens=max_tokens,
                cache_salt=cache_salt,
                index=i,
                arrival_time=arrival_time,
                mm_inputs=prompt.mm_inputs,
            )
            req.lora = lora
            if grammar is not None:
                req.grammar = grammar.matcher()
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
            if i > 0:
                req.fork_of = states[0].req
            states.append(RequestState(req, self.tokenizer, request_id))
        self.groups[request_id] = PromptGroup(request_id, prompt.text, states, delta)
        for s in states:
            self.states[s.req.request_id] = s
            self.scheduler.add_request(s.req)
        return request_id

    def _lora(self, params: SamplingParams) -> tuple[tuple[int, float], ...]:
        """The request's adapters as (slot, factor) pairs (`LoraSet.resolve`)."""
        if self.loras is None:
            if params.lora:
                raise ValueError("this model has no LoRA adapters loaded (--lora)")
            return ()
        return self.loras.resolve(params.lora)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty (no tokens to condition on)")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit the context of {self.max_model_len} "
                "(it needs room for at least one generated token)"
            )
        v = self.vocab_size
        named = [
            ("prompt", ids),
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("banned_token_ids", params.banned_token_ids or ()),
            ("logit_bias", list(params.logit_bias or ())),
        ]
        for name, values in named:
            bad = [t for t in values if not 0 <= t < v]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary 0..{v - 1}")
        self._lora(params)  # an unknown adapter id fails here, before the engine thread

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            for s in group.states:
                self.scheduler.finish(s.req, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns an output for every request that changed."""
        sched = self.scheduler.schedule()
        sampled = {}
        if not sched.empty:
            try:
                result = self.runner.execute(sched)
            except Exception as e:  # one bad step must not take the engine down
                log.exception("engine step failed")
                for req in sched.requests:
                    req.error = f"{type(e).__name__}: {e}"
                    self.scheduler.finish(req, "error")
            else:
                sampled = result.sampled
                for rid, lps in result.prompt_logprobs.items():
                    self.states[rid].req.prompt_logprobs.extend(lps)
                ids = {rid: [t.token_id for t in toks] for rid, toks in sampled.items()}
                self.scheduler.update_from_output(sched, ids)
        now = time.monotonic()
        changed: dict[str, set[int]] = {}
        for rid, toks in sampled.items():
            state = self.states.get(rid)
            if state is None:
                continue
            req = state.req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            req.metrics.num_generated = req.num_output_tokens
            state.add_tokens(toks, lambda why, stop, r=req: self.scheduler.finish(r, why, stop))
            changed.setdefault(state.group_id, set()).add(req.index)
        self._propose()
        return self._collect(changed)

    def _propose(self) -> None:
        if self.proposer is None:
            return
        for req in self.scheduler.running:
            if req.grammar is not None or req.num_computed_tokens != req.num_tokens - 1:
                continue
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
            req.spec_token_ids = self.proposer.propose(req.token_ids, limit=room - 1)

    def _collect(self, changed: dict[str, set[int]]) -> list[RequestOutput]:
        outputs = []
        # Finished without new tokens this step (abort, error): report them too.
        for gid, group in list(self.groups.items()):
            if gid not in changed and not group.finished:
                continue
            outputs.append(group.output(changed.get(gid, set())))
            if group.finished:
                del self.groups[gid]
                for s in group.states:
                    self.states.pop(s.req.request_id, None)
        return outputs

    def close(self) -> None:
        for gid in list(self.groups):
            self.abort_request(gid)
        self.runner.close()  # a step launched ahead may still read host experts
        for source in getattr(self.model, "expert_sources", ()):  # reader threads, open files
            if hasattr(source, "close"):
                source.close()
        self.gguf.close()
        release_free_memory()  # (whatever the model's blocks leave free in the heap)

    def chat_prompt(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
        tools: Sequence[dict] | None = None,
        **template_kwargs,
    ) -> list[int]:
        """Token ids of `messages` through the model's chat template (ChatML when it has none).

        `continue_final`: the prompt ends inside the last message (an assistant's answer begun
        by the caller), so generation continues its text instead of opening a new turn.
        """
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, continue_final=continue_final,
            tools=tools, **template_kwargs,
        )  # fmt: skip
        return self.encode_chat(text)

    def render_chat(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
        tools: Sequence[dict] | None = None,
        **template_kwargs,
    ) -> str:
        """The prompt text of `messages` through the chat template (see `chat_prompt`)."""
        self._check_generates()
        if self._chat_template is None:
            self._chat_template = ChatTemplate.for_tokenizer(self.tokenizer)
        t = self._chat_template
        if continue_final:
            return continued_render(t, messages, tools=tools, **template_kwargs)
        return t.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of a rendered chat: special tokens parsed, BOS added unless it is there."""
        t = self._chat_template or ChatTemplate.for_tokenizer(self.tokenizer)
        add_bos = not (t.bos_token and text.startswith(t.bos_token))
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=True)

    def _check_generates(self) -> None:
        if not self.generates:
            raise ValueError(
                f"{self.model.args.arch} is an encoder-only (embedding) model: it cannot generate "
                "text, only embed (POST /v1/embeddings, LLMEngine.embed)"
            )

    # -- embeddings -------------------------------------------------------------------------

    @property
    def embedding_dim(self) -> int:
        return self.embedder.dim

    @property
    def can_rank(self) -> bool:
        """A cross-encoder (a classification head): `embed(pairs, pooling="rank")` scores."""
        return self.embedder.can_rank

    def prepare_embedding(
        self, inputs: Sequence[str | Sequence[int] | RankPair], truncate: int | None = None
    ) -> list[list[int]]:
        """Tokenize and check embedding inputs (no engine state: any thread). A `RankPair`
        becomes its pair prompt; `truncate` then cuts the document."""
        return self.embedder.prepare(inputs, truncate)

    def embedding_job(
        self, seqs: list[list[int]], pooling: str | None = None, normalize: bool = True
    ) -> EmbedJob:
        """A job over prepared inputs; its `step()`s must run where `step()` runs."""
        return self.embedder.job(seqs, pooling, normalize)

    def embed(
        self,
        inputs: Sequence[str | Sequence[int] | RankPair],
        pooling: str | None = None,
        normalize: bool = True,
        truncate: int | None = None,
    ) -> list[EmbeddingOutput]:
        """One vector per input: final hidden states pooled (`mean`, `cls` or `last`; None: the
        model's own, see `engine.layers.pooling`) and L2-normalised unless `normalize` is False.
        `pooling="rank"` (a cross-encoder, `can_rank`): the classification head's scores of each
        input, usually `RankPair`s, never normalised.
        Synchronous, on the calling thread: with an `AsyncEngine`, use its `embed`."""
        seqs = self.prepare_embedding(inputs, truncate)
        return self.embedding_job(seqs, pooling, normalize).run()
