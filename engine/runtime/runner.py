"""The model runner: turns a scheduled step into one forward pass over a flat token batch.

It owns the device state (the model and the paged KV tensors), builds the batch metadata (block
tables, slot mapping, query offsets), computes logits only for the rows that need them (the last
known token of each request, draft tokens being verified, prompt-logprob positions) and samples.
Draft verification is exact: a draft token is kept only if the target samples exactly it, and
randomness is drawn one row at a time so a seeded request draws the same numbers with or without
speculation. On CUDA, steps where every request decodes one token replay a captured decode graph
(`DecodeGraphs`; steps whose tokens the device picks are launched one ahead, `DecodeAhead`), a
step of one request's prompt chunk replays a prompt graph (`PrefillGraphs`, given a spare KV slot
for its padding); everything else (batches of prompts, drafts, CPU) runs eagerly. Hybrid models
(recurrent state) replay decode graphs too, their rows naming each sequence's state slot; they
launch nothing ahead, and take prompt graphs while `prefill_graphs.STATEFUL` is on (the default).
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.core.outputs import PositionLogprobs
from localllm.engine.core.request import Request
from localllm.engine.core.scheduler import SchedulerOutput
from localllm.engine.moe.block import moe_blocks
from localllm.engine.multimodal import EncoderCache, pending, step_embeds
from localllm.engine.runtime.cuda_graphs import DecodeGraphs, pack_decode
from localllm.engine.runtime.decode_ahead import DecodeAhead, warm_up
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.prefill_graphs import PrefillGraphs
from localllm.engine.sampling.device import DeviceDraw
from localllm.engine.sampling.sampler import (
    SampledToken,
    Sampler,
    SamplingRow,
    check_maxima,
    drawn_on_device,
    needs_processing,
    prompt_logprobs,
)
from localllm.kernels.quant.linear_native import prompt_rows


@dataclass(slots=True)
class RunnerOutput:
    # request_id -> tokens accepted this step (empty when a prompt chunk did not reach its end)
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request_id -> logprobs of prompt positions computed this step
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)


@dataclass(slots=True)
class _Rows:
    """Where each request's logits rows sit in the flat hidden states."""

    sample: dict[str, list[int]] = field(default_factory=dict)
    prompt: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # rows, targets


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv: PagedKVCache,
        block_ids,
        cuda_graphs: bool = True,
        spare_slot: int | None = None,
        max_blocks: int = 0,
        decode_ahead: bool = True,
        state_slot=None,
    ):
        self.model = model
        self.kv = kv
        self.block_ids = block_ids  # request -> its block table (the KV manager's view)
        self.state_slot = state_slot  # request -> its recurrent-state slot (stateful models)
        self.sampler = Sampler()
        self.device = kv.device  # the model's and the cache's device
        self.encoder_cache = EncoderCache()  # image embeddings by content hash
        # MoE layers whose experts are read or computed on the host are captured in pieces;
        # recurrent-state models read their state slots from the graph's rows (the spare KV slot,
        # which their prompts leave unused, takes the padding rows' writes)
        use = cuda_graphs and self.device.type == "cuda"
        stateless = kv.states is None
        pad = None if stateless else spare_slot
        self.graphs = DecodeGraphs(model, kv, pad_slot=pad) if use else None
        # decode steps whose tokens the device picks, launched one ahead (off where drafts would
        # change the next step, and for recurrent state: a dropped launch has already advanced
        # its sequences' states, which unlike a KV write cannot be redone)
        ahead = use and decode_ahead and stateless
        self.ahead = DecodeAhead(self.graphs.run) if ahead else None
        # its token work's kernels loaded before any replay, where a split layer's replay waits
        # for the host (`decode_ahead.warm_up`)
        vocab = getattr(getattr(model, "args", None), "vocab_size", 0)
        if self.ahead is not None and vocab and any(b.split for b in moe_blocks(model)):
            warm_up(vocab, self.device)
        # sources whose reads a GPU asks for: a failed read is raised once the step's tokens are
        # sampled (their device work has run), before they reach a request
        self.read_checks = [s for s in getattr(model, "expert_sources", ()) if hasattr(s, "check")]
        self.lora = getattr(model, "lora", None)  # LoRA adapters' per-row factors (engine.lora)
        # `spare_slot`: a KV slot no request owns, where prompt graphs (hybrids: decode graphs)
        # write their padding;
        # `max_blocks`: the longest block table a request can have
        self.prompts = None
        if use and spare_slot is not None:  # (hybrids: `PrefillGraphs.usable` says whether)
            self.prompts = PrefillGraphs(model, kv, spare_slot, max_blocks)
            self.graphs.pool = self.prompts.pool = torch.cuda.graph_pool_handle()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for src, dst in sched.state_copies:  # forks take their sibling's state before it moves
            self.kv.states.copy(src, dst)
        if self.lora is not None:  # each row's adapters, in the flat order both paths lay out
            n = sched.num_scheduled_tokens
            self.lora.set_rows([(r.lora, n[r.request_id]) for r in sched.requests])
        if self.graphs is not None:
            out = self._execute_graph(sched)
            if out is not None:
                return out
        if self.ahead is not None:
            self.ahead.drop()
        ids, positions, rows, batch = self._prepare(sched)
        hidden = None
        plain = batch.embeds is None and not any(r.rope for r in sched.requests)
        if self.prompts is not None and batch.num_seqs == 1 and plain:
            start = batch.seq_lens[0] - len(ids)
            state = batch.state_slots[0] if batch.state_slots else 0
            hidden = self.prompts.run(ids, batch.slot_mapping, start, batch.block_tables[0], state)
        if hidden is None:
            with prompt_rows(batch.prompt_mask()):  # prompt rows on the prompt path (CPU)
                hidden = self.model(ids, positions, batch, self.kv)
        out = RunnerOutput()
        wanted = [r for rs in rows.sample.values() for r in rs]
        wanted += [r for rs, _ in rows.prompt.values() for r in rs]
        if not wanted:
            return out
        # left on the device: greedy rows are answered there (see `Sampler`), the rest copied
        logits = self.model.logits(hidden[torch.tensor(wanted, device=self.device)]).float()
        offset = {r: i for i, r in enumerate(wanted)}
        reqs = {r.request_id: r for r in sched.requests}
        for rid, (prows, targets) in rows.prompt.items():
            k = reqs[rid].params.prompt_logprobs
            out.prompt_logprobs[rid] = prompt_logprobs(
                logits[[offset[r] for r in prows]], targets, k
            )
        self._sample(sched, reqs, rows, logits, offset, out)
        self._check_reads()
        return out

    def close(self) -> None:
        """Drop a step launched ahead and wait for the device: nothing may still read the model's
        host memory (mapped experts, the file's mapping) once its owner closes it."""
        if self.ahead is not None:
            self.ahead.drop()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_reads(self) -> None:
        for source in self.read_checks:
            source.check()

    def _execute_graph(self, sched: SchedulerOutput) -> RunnerOutput | None:
        """The step through a decode graph, or None when it is not a plain decode step."""
        reqs = sched.requests
        if not reqs or len(reqs) > self.graphs.batch_sizes[-1]:
            return None
        bs = self.kv.block_size
        ids, positions, slots, tables, shifts = [], [], [], [], []
        for req in reqs:
            rid, start = req.request_id, req.num_computed_tokens
            if sched.num_scheduled_tokens[rid] != 1 or sched.spec_tokens.get(rid):
                return None
            if start != req.num_tokens - 1 or req.params.prompt_logprobs is not None:
                return None  # (a prompt-logprobs request keeps the eager path throughout)
            if req.mm_inputs and pending(req.mm_inputs, start, 1):
                return None  # an image's last placeholder: its embedding is spliced eagerly
            shift = _rope_shift(req, start)
            if shift is None:
                return None  # an image token's 3-axis position: eager
            table = self.block_ids(req)
            ids.append(req.token_ids[start])
            positions.append(start)
            shifts.append(shift)
            slots.append(table[start // bs] * bs + start % bs)
            tables.append(table)
        # built only for a launch: a step launched ahead reads the rows it was launched with
        states = self._state_slots(reqs) or None
        inputs = lambda: pack_decode(ids, positions, slots, tables, shifts, states)
        if self.ahead is not None:
            if all(self._picked_on_device(r) for r in reqs):
                return self._execute_ahead(reqs, inputs, ids, positions, tables)
            self.ahead.drop()
        logits = self.graphs.run(inputs())
        if logits is None:
            return None
        out = RunnerOutput()
        rows = _Rows(sample={r.request_id: [i] for i, r in enumerate(reqs)})
        offset = {i: i for i in range(len(reqs))}
        self._sample(sched, {r.request_id: r for r in reqs}, rows, logits, offset, out)
        self._check_reads()
        return out

    def _picked_on_device(self, req: Request) -> bool:
        """Nothing for the host to do: the device picks its token (argmax or draw)."""
        p = req.params
        if req.grammar is not None or p.logprobs is not None:
            return False
        row = self._row(req, [])
        return not needs_processing(row) or drawn_on_device(row)

    @staticmethod
    def _drawer(reqs):
        """The draw of a step's sampled rows, made when the step is launched."""
        on = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not on:
            return lambda: None
        return lambda: DeviceDraw.draw(on, [reqs[i].params for i in on], [reqs[i].rng for i in on])

    def _execute_ahead(self, reqs, inputs, ids, positions, tables) -> RunnerOutput | None:
        """A decode step whose tokens the device picks, the next one launched before they are read
        (`DecodeAhead`); None when its shape runs eager."""
        key = _step_key(reqs, positions)
        draw = self._drawer(reqs)
        cur = self.ahead.run(key, inputs, ids, draw)
        if cur is None:
            return None
        nxt = self._next_step(reqs, positions, tables)
        if nxt is not None:
            self.ahead.ahead(cur, *nxt, draw)
        maxima, chosen = self.ahead.read(cur)
        check_maxima(maxima)
        sampled = {r.request_id: [SampledToken(t)] for r, t in zip(reqs, chosen, strict=True)}
        self._check_reads()
        return RunnerOutput(sampled)

    def _next_step(self, reqs, positions, tables):
        """(key, inputs) of the decode step after this one, or None where a request ends with
        this step's token or its next position has no block yet (the scheduler's to give)."""
        bs = self.kv.block_size
        nxt = [p + 1 for p in positions]
        for req, p, table in zip(reqs, nxt, tables, strict=True):
            if req.num_output_tokens + 1 >= req.max_tokens or p // bs >= len(table):
                return None
        slots = [t[p // bs] * bs + p % bs for p, t in zip(nxt, tables, strict=True)]
        shifts = [r.rope.delta if r.rope else 0 for r in reqs]  # past the prompt: a constant
        return _step_key(reqs, nxt), pack_decode([0] * len(nxt), nxt, slots, tables, shifts)

    def _prepare(self, sched: SchedulerOutput):
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, seq_lens, tables, prompt = [0], [], [], []
        rows = _Rows()
        mm_rows: list[int] = []
        mm_values: list[torch.Tensor] = []
        ropes = [] if any(r.rope for r in sched.requests) else None  # M-RoPE: [3, n] per request
        for req in sched.requests:
            rid = req.request_id
            n = sched.num_scheduled_tokens[rid]
            start = req.num_computed_tokens
            spec = sched.spec_tokens.get(rid, [])
            toks = (req.token_ids + spec)[start : start + n]
            table = self.block_ids(req)
            base = len(ids)
            if req.mm_inputs:
                try:
                    r, v = step_embeds(
                        req.mm_inputs, start, n, base, self.encoder_cache, self._dim, self.device
                    )
                except Exception as e:  # this request fails (its step ends it), not the batch
                    req.error = f"encoding its image failed: {type(e).__name__}: {e}"
                    r, v = [], []
                mm_rows += r
                mm_values += v
            ids += toks
            positions += range(start, start + n)
            if ropes is not None:
                rope = req.rope.rows(start, n) if req.rope else torch.arange(start, start + n)
                ropes.append(rope)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_start.append(len(ids))
            prompt.append(start < req.num_prompt_tokens)  # (`BatchMeta.prompt`)
            seq_lens.append(start + n)
            tables.append(tuple(table))
            if start + n >= req.num_tokens:
                # The last known token predicts the next one; each draft predicts the one after it.
                first = base + (req.num_tokens - 1 - start)
                rows.sample[rid] = list(range(first, base + n))
            self._prompt_rows(req, start, n, base, rows)
        # ids, positions and slots travel to the device in one host-to-device copy
        t = len(ids)
        packed = torch.tensor(ids + positions + slots, dtype=torch.long).to(self.device)
        batch = BatchMeta(
            query_start=tuple(query_start),
            seq_lens=tuple(seq_lens),
            block_tables=tuple(tables),
            slot_mapping=packed[2 * t :],
            block_size=bs,
            embeds=self._embeds(mm_rows, mm_values),
            state_slots=tuple(self._state_slots(sched.requests)),
            prompt=tuple(prompt),
        )
        pos = packed[t : 2 * t]
        if ropes is not None:  # the 3-axis positions, in a second copy
            pos = torch.cat([r.expand(3, -1) for r in ropes], 1).to(self.device)
        return packed[:t], pos, rows, batch

    def _state_slots(self, reqs) -> list[int]:
        if self.kv.states is None:
            return []
        return [self.state_slot(r) for r in reqs]

    @property
    def _dim(self) -> int:
        # a multimodal row may be wider than the model (Qwen3-VL: + its deepstack parts)
        return getattr(self.model, "mm_width", 0) or self.model.args.dim

    def _embeds(self, rows: list[int], values: list[torch.Tensor]):
        if not rows:
            return None
        index = torch.tensor(rows, dtype=torch.long).to(self.device)
        return index, torch.cat(values) if len(values) > 1 else values[0]

    @staticmethod
    def _prompt_rows(req: Request, start: int, n: int, base: int, rows: _Rows) -> None:
        if req.params.prompt_logprobs is None:
            return
        # Position p predicts prompt token p + 1; positions already reported are skipped
        # (a preempted request recomputes its prompt).
        first = max(start, len(req.prompt_logprobs) - 1, 0)
        last = min(start + n, req.num_prompt_tokens - 1)
        if first >= last:
            return
        prow = [base + p - start for p in range(first, last)]
        rows.prompt[req.request_id] = (prow, req.prompt_token_ids[first + 1 : last + 1])

    def _sample(self, sched, reqs, rows: _Rows, logits, offset, out: RunnerOutput) -> None:
        order = list(rows.sample)
        if not order:
            return
        # First row of every request in one batched call, then drafts one row at a time.
        first_rows = [self._row(reqs[rid], []) for rid in order]
        first = self.sampler(logits[[offset[rows.sample[rid][0]] for rid in order]], first_rows)
        for rid, tok in zip(order, first, strict=True):
            req, accepted = reqs[rid], [tok]
            spec = sched.spec_tokens.get(rid, [])
            for j, draft in enumerate(spec):
                if accepted[-1].token_id != draft:
                    break
                row = self._row(req, spec[: j + 1])
                accepted += self.sampler(logits[[offset[rows.sample[rid][j + 1]]]], [row])
            out.sampled[rid] = accepted

    @staticmethod
    def _row(req: Request, drafts: list[int]) -> SamplingRow:
        allowed = req.grammar.allowed() if req.grammar is not None else None
        if allowed is not None and not bool(allowed.any()):
            # A dead end (no token can continue the grammar): end this request, not the batch.
            req.error = f"the grammar allows no next token ({req.grammar.error or 'dead end'})"
            allowed = None
        return SamplingRow(
            params=req.params,
            rng=req.rng,
            prompt_ids=req.prompt_token_ids,
            output_ids=req.output_token_ids + drafts if drafts else req.output_token_ids,
            eos_ids=req.eos_ids,
            allowed=allowed,
        )


def _rope_shift(req: Request, p: int) -> int | None:
    """What token p's rope position adds to p (M-RoPE text after an image; 0 for plain rope),
    or None where its three axes differ (an image token)."""
    if req.rope is None:
        return 0
    flat = req.rope.flat(p)
    return None if flat is None else flat - p


def _step_key(reqs, positions) -> tuple[tuple[str, int], ...]:
    """(request id, position) per row: the step a launch computes (`decode_ahead.StepKey`)."""
    return tuple((r.request_id, p) for r, p in zip(reqs, positions, strict=True))
