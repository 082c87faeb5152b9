"""Start-up warm-up: every CUDA graph and triton kernel a server's requests will meet, made before
the first request, so none waits for a capture or a compile (issue 38: one request of eight
waited 6.9 s for its first token, its prompt length met for the first time).

What the first requests would otherwise make lazily, on a GPU:
- a prompt graph per padded length (`PrefillGraphs`, the buckets up to one step's token budget:
  a longer prompt is cut into chunks of that budget);
- a decode graph per (batch size of the ladder, table width) (`DecodeGraphs`: widths double from
  `MIN_BLOCKS` up to the longest block table the context allows);
- the triton kernels of the eager steps (a step that is not one prompt chunk and not only
  decoders): a prompt chunk beside decoders at every context class and row count the KV pool
  holds (flash decoding's split count follows both), short lone chunks, and the output head on
  1 to 9 rows (the GEMVs take up to `GEMV_MAX_M` rows, each count its own launch geometry), each
  once per class triton tells integer arguments apart by (1, a multiple of 16, neither);
- what the engine's own steps run beside the model: a few real requests (`warm_requests`:
  samplers, the step launched ahead, the scheduler's mixed steps).
`plan` says what a mode warms (pure: CPU-tested); `warm_engine` does it. The graphs' and eager
steps' writes go to the cache's spare block (a block no sequence owns), every table points at
it: nothing a request will read is touched. On a CPU (no graphs, no triton) it does nothing.
"""

import time
from dataclasses import dataclass

import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.moe.block import moe_blocks
from localllm.engine.runtime.cuda_graphs import BATCH_SIZES, MIN_BLOCKS
from localllm.engine.runtime.prefill_graphs import BUCKETS

MODES = ("full", "decode", "none")  # `localllm serve --warmup`; full is the default
# Eager steps warmed in `full`, as (new tokens, context after) per sequence. Triton compiles a
# kernel per class of each integer argument (1, a multiple of 16, neither) and per constexpr:
# - a prompt chunk beside a decoder (a mixed step): chunk tokens T and first position Q0 (and
#   so keys M = Q0 + T) in each class they can take together;
CHUNKS = ((48, 0), (48, 5), (48, 1), (47, 0), (47, 5), (47, 17), (47, 1))  # (T, Q0)
# - a lone sequence's step too short for a prompt graph (or one token after a cached prefix);
LONE = (((16, 16),), ((17, 17),), ((17, 22),), ((1, 40),), ((1, 1),))
# - decoders beside a chunk: the flash-decoding split count (a power of two, a constexpr) follows
#   the longest context and the number of decoding rows (one split below 17 keys), so contexts
#   5 and 16 to the model's length doubling, each once a multiple of 16 and once not (rows of
#   unequal lengths: padded), at these row counts (as many as the KV pool can hold at once)
DECODERS = (1, 2, 4, 8, 16, 32, 63)
_NEIGHBOUR = (1, 300)  # the decoder beside each chunk of CHUNKS
HEAD_ROWS = (*range(1, 10), 16, 17)


@dataclass(frozen=True, slots=True)
class WarmPlan:
    """What a warm-up makes: prompt buckets, decode (batch size, table width) pairs, eager
    steps (tokens per sequence) and output-head row counts."""

    buckets: tuple[int, ...] = ()
    decode: tuple[tuple[int, int], ...] = ()
    eager: tuple[tuple[tuple[int, int], ...], ...] = ()
    head_rows: tuple[int, ...] = ()


@dataclass(slots=True)
class WarmReport:
    mode: str
    captured: int = 0  # graphs made (prompt + decode)
    seconds: float = 0.0
    failed: str | None = None  # why a capture failed (that shape and larger: left to first use)

    def line(self) -> str:
        why = f"; capture failed: {self.failed}" if self.failed else ""
        return f"warm-up {self.mode}: {self.captured} graphs in {self.seconds:.1f} s{why}"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"--warmup must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def widths(max_blocks: int) -> tuple[int, ...]:
    """The decode graphs' table-width buckets a sequence of up to `max_blocks` blocks meets."""
    out, w = [MIN_BLOCKS], MIN_BLOCKS
    while w < max_blocks:
        w *= 2
        out.append(w)
    return tuple(out)


def plan(
    mode: str,
    *,
    prompts: bool,
    decode: bool,
    max_num_seqs: int,
    token_budget: int,
    max_model_len: int,
    block_size: int,
    pool_tokens: int | None = None,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    grid: bool = True,
) -> WarmPlan:
    """What `mode` warms for an engine whose runner has prompt graphs (`prompts`) and decode
    graphs (`decode`): buckets up to the one a budget-long chunk pads to (within the context),
    batch sizes up to the one `max_num_seqs` rows pad to, every table width of the context; the
    eager steps a step of at most `max_num_seqs` sequences, `token_budget` tokens and
    `pool_tokens` cached tokens (the KV pool; default one context) can take (`grid`: the
    decoders' grid too; off where experts are read from the host, each step a slow one)."""
    check_mode(mode)
    if mode == "none" or not (prompts or decode):
        return WarmPlan()
    pairs: tuple[tuple[int, int], ...] = ()
    if decode:
        top = next((b for b in batch_sizes if b >= max_num_seqs), batch_sizes[-1])
        sizes = [b for b in batch_sizes if b <= top]
        ws = widths(-(-max_model_len // block_size))
        pairs = tuple((b, w) for w in ws for b in sizes)  # narrow tables first: met first
    if mode == "decode":
        return WarmPlan(decode=pairs)
    longest = min(token_budget, max_model_len)
    top_bucket = _bucket(longest) if longest >= BUCKETS[0] else None
    buckets = tuple(b for b in BUCKETS if b <= longest or b == top_bucket) if prompts else ()
    pool = pool_tokens or max_model_len
    eager = tuple(
        m for m in eager_steps(max_num_seqs, max_model_len, grid)
        if sum(n for n, _ in m) <= token_budget and len(m) <= max_num_seqs
        and all(c <= max_model_len for _, c in m) and sum(c for _, c in m) <= pool
    )  # fmt: skip
    head = tuple(r for r in HEAD_ROWS if r <= max(max_num_seqs, 1))
    return WarmPlan(buckets, pairs, eager, head)


def eager_steps(
    max_num_seqs: int, max_model_len: int, grid: bool = True
) -> list[tuple[tuple[int, int], ...]]:
    """Every eager step of the lists above, before the limits of a step and of the pool."""
    steps = [(_NEIGHBOUR, (t, q0 + t)) for t, q0 in CHUNKS]
    steps += LONE
    if not grid:
        return steps
    contexts, m = [5], 16
    while m < max_model_len:
        contexts.append(m)
        m *= 2
    contexts.append(max_model_len)
    for nd in DECODERS:
        if nd >= max_num_seqs:  # the chunk beside them is a sequence too
            break
        for m in contexts:
            steps.append(((1, m),) * nd + ((48, 48),))
            uneven = tuple((1, m + 5 if i % 2 == 0 else m) for i in range(nd))
            steps.append((*uneven, (48, 48)))
    return steps


def _bucket(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


def engine_plan(engine, mode: str) -> WarmPlan:
    """`plan` for an `LLMEngine` (the graphs its runner made, its limits)."""
    runner, args = engine.runner, engine.args
    if not engine.generates:  # an encoder (embeddings) never decodes
        return WarmPlan()
    blocks = moe_blocks(runner.model)
    resident = not any(b.mapped is not None or b.split is not None for b in blocks)
    return plan(
        mode,
        prompts=runner.prompts is not None and runner.prompts.usable,
        decode=runner.graphs is not None,
        max_num_seqs=args.max_num_seqs,
        token_budget=args.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        block_size=args.block_size,
        pool_tokens=engine.kv_plan.num_blocks * args.block_size,
        batch_sizes=runner.graphs.batch_sizes if runner.graphs is not None else BATCH_SIZES,
        grid=resident,
    )


@torch.inference_mode()
def warm_engine(engine, mode: str) -> WarmReport:
    """Make what `engine_plan(engine, mode)` lists, on the calling thread (nothing else may use
    the engine meanwhile: a server warms before it listens)."""
    t0 = time.perf_counter()
    report = WarmReport(mode)
    p = engine_plan(engine, mode)
    runner = engine.runner
    if not (p.buckets or p.decode or p.eager):
        return report
    spare_block = engine.kv_plan.num_blocks  # the block past the plan (`LLMEngine`: spare = 1)
    bs = engine.args.block_size
    before = _captured(runner)
    stops: list[tuple[int, int]] = []  # (batch, width) whose capture failed
    for b, w in p.decode:
        if any(b >= sb and w >= sw for sb, sw in stops):
            continue
        _lora_rows(runner, [1] * b)
        if not runner.graphs.warm(b, w, spare_block, bs):
            stops.append((b, w))
            report.failed = report.failed or runner.graphs.failed
            # a shape no request may ever take must not turn the graphs off for every step:
            # what was captured stays in use, a failing shape fails again on its first use
            runner.graphs.failed = None
    for n in p.buckets:
        _lora_rows(runner, [n])
        if not runner.prompts.warm(n, spare_block, bs):
            report.failed = report.failed or runner.prompts.failed
            runner.prompts.failed = None  # (as above; longer buckets are left to first use)
            break
    if runner.kv.states is None:  # a hybrid's eager step needs real state slots
        _warm_eager(runner, p, spare_block, bs)
    if p.eager:
        warm_requests(engine)
    torch.cuda.synchronize(runner.device)
    report.captured = _captured(runner) - before
    report.seconds = time.perf_counter() - t0
    return report


def _lora_rows(runner, counts: list[int]) -> None:
    """LoRA adapters loaded: a step's rows on none of them, as `ModelRunner.execute` sets them
    (the captures of steps on an adapter are made on first use)."""
    if runner.lora is not None:
        runner.lora.set_rows([((), n) for n in counts])


def _captured(runner) -> int:
    return sum(len(g.graphs) for g in (runner.graphs, runner.prompts) if g is not None)


def _warm_eager(runner, p: WarmPlan, spare_block: int, bs: int) -> None:
    """The eager steps of `p.eager` (every table all spare block, every write to its first
    slot), then the output head on each of `p.head_rows` rows."""
    dev = runner.device
    hidden = None
    for seqs in p.eager:
        starts = [0]
        for n, _ in seqs:
            starts.append(starts[-1] + n)
        total = starts[-1]
        tables = tuple((spare_block,) * -(-c // bs) for _, c in seqs)
        ids = torch.zeros(total, dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(c - n, c, device=dev) for n, c in seqs])
        slots = torch.full((total,), spare_block * bs, dtype=torch.long, device=dev)
        meta = BatchMeta(tuple(starts), tuple(c for _, c in seqs), tables, slots, bs)
        _lora_rows(runner, [n for n, _ in seqs])
        hidden = runner.model(ids, pos, meta, runner.kv)
    if hidden is None:
        return
    for r in p.head_rows:
        rows = torch.zeros(r, dtype=torch.long, device=dev)
        runner.model.logits(hidden[rows]).float()


# the real requests' prompt lengths: a long one first, the others join while it decodes
REQUEST_LENGTHS = (300, 40, 100, 9)


def warm_requests(engine, max_tokens: int = 6) -> None:
    """A few requests through the engine's own steps (`LLMEngine.add_request`/`step`, before
    any other request exists): greedy, drawn (seeded) and host-processed (penalties) rows, one
    joining while others decode, so the scheduler's mixed steps, the samplers and the step
    launched ahead run once. Their token ids are arbitrary; what they leave in the prefix cache
    no prompt of a client's matches."""
    from localllm.engine.sampling.params import SamplingParams

    kinds = (
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1, seed=2,
                       max_tokens=max_tokens, ignore_eos=True),
    )  # fmt: skip
    vocab = engine.vocab_size
    for i, n in enumerate(REQUEST_LENGTHS):
        n = max(1, min(n, engine.max_model_len - max_tokens - 1))
        ids = [(7 + 7919 * (i * 1000 + j)) % vocab for j in range(n)]
        engine.add_request(f"warmup-{i}", ids, kinds[i % len(kinds)])
        for _ in range(2):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
