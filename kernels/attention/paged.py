"""Plain-torch paged attention reference: KV writes by slot mapping, causal GQA over block tables.

A layer's cache is a tensor [num_blocks, block_size, kv_heads, head_dim] (the layout flash/paged
kernels use); token p of a sequence lives in block `table[p // block_size]` at offset
`p % block_size`, i.e. slot `table[p // block_size] * block_size + p % block_size`. 8-bit caches
carry a scales tensor shaped like the values up to the head axis (see `kv_quant`).

The new queries of a sequence are its LAST tokens: with t queries and context length n, query i sits
at position n - t + i. Each sequence gathers the blocks it needs (a zero-copy view when the ids are
consecutive, one index_select otherwise), decodes them to the query dtype and runs dense math.
On the CPU, every row over plain float caches takes a native kernel instead: prompt rows
(`prompt`; without flags, sequences of several rows) `kernels.cpu.prompt_attention`, decode rows
`kernels.cpu.paged_decode` (images' two-way spans aside), so a row's bits depend neither on the
rest of the batch nor on how its prompt was chunked (SDPA's blocks follow the call's query count).
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from localllm.kernels.attention.decode import decode_attention
from localllm.kernels.attention.decode_plan import DecodePlan, host_tables
from localllm.kernels.attention.kv_quant import decode_kv
from localllm.kernels.cpu import paged_decode, prompt_attention

if TYPE_CHECKING:
    from localllm.kernels.quant.triton_packed import QuantizedX


def write_paged(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache[slot // block_size, slot % block_size] = values[i] for each slot_mapping[i].

    cache [num_blocks, block_size, *rest], values [T, *rest] (already in the cache dtype or
    castable), slot_mapping [T] int64.
    """
    flat = cache.flatten(0, 1)
    if values.dtype != cache.dtype:
        values = values.to(cache.dtype)
    if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 CPU kernel: copy the bytes
        flat, values = flat.view(torch.uint8), values.view(torch.uint8)
    flat.index_copy_(0, slot_mapping, values)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    decode: DecodePlan | None = None,
    sinks: torch.Tensor | None = None,
    quant: "QuantizedX | None" = None,
    spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    prompt: Sequence[bool] | None = None,
    shrink=None,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's new queries over its paged context.

    q [T, H, D] (sequence b owns rows query_start[b]:query_start[b+1]); k_cache/v_cache
    [num_blocks, block_size, KV, D|Dv] in a float, int8 (q8_0) or float8 (fp8) format with their
    scales; H must be a multiple of KV. `window` keeps the last `window` keys of each query (key
    positions > query position - window); `softcap` squashes scores to cap * tanh(s / cap).
    `decode` (from `plan_decode` for the same layout and window) runs every single-token sequence
    in one batched gather. `sinks` [H] (gpt-oss) are per-head logits of a virtual key with a zero
    value: they join each softmax's denominator only. Returns [T, H, Dv] in q's dtype (possibly
    a non-contiguous view). `quant`: `decode.quantized_output`'s buffers for `decode`, which the
    flash-decoding kernel fills with the output rows quantized; `shrink`: the output
    projection's LoRA shrink for that kernel (`decode.serves_every_row`). `spans` (per sequence,
    position ranges [a, b) that lie within its context): a query inside a range also sees every
    key of that range (Gemma 3's bidirectional image tokens; the window still applies), on CUDA
    in the flash prefill kernel too. `prompt` (`BatchMeta.prompt`): which sequences' rows are prompt
    rows (the CPU's prompt kernel, a one-row tail too); None: those with several rows.
    """
    if decode is None and (quant is not None or shrink is not None):
        raise ValueError("quant and shrink need a decode plan")
    # (a plan without host tables is a graph's, built from device tensors: the host lengths and
    # tables here are placeholders then)
    if (
        q.device.type == "cpu"
        and quant is None
        and shrink is None
        and (decode is None or decode.lens is not None)
        and paged_decode.supports(q, k_cache, v_cache, softcap, sinks, k_scales)
    ):
        return _native_cpu(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale,
                           window, decode, spans, prompt)  # fmt: skip
    if decode is not None:
        return _with_plan(
            q,
            k_cache,
            v_cache,
            query_start,
            seq_lens,
            block_tables,
            scale,
            window,
            softcap,
            k_scales,
            v_scales,
            decode,
            sinks,
            quant,
            spans,
            shrink,
        )
    outs = _each(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale, window, softcap,
                 k_scales, v_scales, sinks, spans)  # fmt: skip
    if len(outs) == 1:  # one sequence (the CPU decode case): no concatenation copy
        return outs[0]
    return torch.cat(outs) if outs else q.new_empty(0, q.shape[1], v_cache.shape[-1])


# CPU prompt rows: "tiled" (`kernels.cpu.prompt_attention`, the default: chunk-invariant bits,
# each K/V block read once per tile of rows), "rows" (each row through `paged_decode`, also
# chunk-invariant, 4-11x slower on 512 rows; a one-row prompt tail as a decode row) or "sdpa"
# (torch's chunk path: bits depend on the chunk). tests/perf/results/cpu.md has the A/B.
CPU_PROMPT_ATTENTION = "tiled"


def _native_cpu(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale, window,
                decode: DecodePlan | None, spans, prompt) -> torch.Tensor:  # fmt: skip
    """The CPU path: `kernels.cpu.prompt_attention` for prompt rows, `kernels.cpu.paged_decode`
    for every other single-token sequence and other chunks' rows (each row's bits independent of
    the other rows), the torch chunk path for chunks with two-way spans."""
    t = [query_start[b + 1] - query_start[b] for b in range(len(seq_lens))]
    tiled = []
    if CPU_PROMPT_ATTENTION == "tiled" and prompt_attention.load() is not None:
        flags = prompt or [n > 1 for n in t]
        tiled = [b for b, n in enumerate(t) if n and flags[b] and not (spans and spans[b])]
    if any(t[b] == 1 for b in tiled):  # the plan's rows include this prompt row
        decode = None
    one = [b for b in range(len(seq_lens)) if t[b] == 1 and b not in tiled]
    if not tiled and not any(n > 1 for n in t) and len(one) == 1:  # lone decode: no output copy
        b = one[0]
        if decode is not None:  # (a graph's plan: the batch's lengths are placeholders)
            lens, tables = decode.lens, decode.tables
        else:
            lens, tables = host_tables([seq_lens[b]], [block_tables[b]])
        return paged_decode.paged_decode(q[query_start[b] : query_start[b] + 1], k_cache,
                                         v_cache, lens, tables, scale, window)  # fmt: skip
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    if tiled:
        prompt_attention.prompt_attention(q, k_cache, v_cache, query_start, seq_lens,
                                          block_tables, scale, window, out=out,
                                          seqs=tiled)  # fmt: skip
        t = [0 if b in tiled else n for b, n in enumerate(t)]
    if one:
        if decode is not None:
            lens, tables = decode.lens, decode.tables
        else:
            lens, tables = host_tables([seq_lens[b] for b in one], [block_tables[b] for b in one])
        rows = [query_start[b] for b in one]
        out[rows] = paged_decode.paged_decode(q[rows], k_cache, v_cache, lens, tables, scale,
                                              window)  # fmt: skip
    chunks = [b for b in range(len(seq_lens)) if t[b] > 1 and not (spans and spans[b])]
    if chunks and CPU_PROMPT_ATTENTION != "sdpa":  # each row as its own query over its keys
        rows = [r for b in chunks for r in range(query_start[b], query_start[b + 1])]
        lens = [n for b in chunks for n in range(seq_lens[b] - t[b] + 1, seq_lens[b] + 1)]
        tabs = [block_tables[b] for b in chunks for _ in range(t[b])]
        lens, tables = host_tables(lens, tabs)
        out[rows] = paged_decode.paged_decode(q[rows], k_cache, v_cache, lens, tables, scale,
                                              window)  # fmt: skip
        t = [0 if b in chunks else n for b, n in enumerate(t)]
    for b in range(len(seq_lens)):
        if t[b] > 1:
            s, e = query_start[b], query_start[b + 1]
            out[s:e] = _each(q[s:e], k_cache, v_cache, (0, e - s), (seq_lens[b],),
                             (block_tables[b],), scale, window, None, None, None, None,
                             None if spans is None else (spans[b],))[0]  # fmt: skip
    return out


def _each(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale, window, softcap,
          k_scales, v_scales, sinks, spans) -> list[torch.Tensor]:  # fmt: skip
    """Each sequence's attention in turn (sequences without new tokens give nothing)."""
    bs = k_cache.shape[1]
    outs = []
    for b, n in enumerate(seq_lens):
        s, e = query_start[b], query_start[b + 1]
        t = e - s
        if t == 0:  # a sequence with no new tokens this step
            continue
        lo = max(0, n - t + 1 - window) if window else 0  # first key any query here can see
        b0, b1 = lo // bs, (n - 1) // bs + 1
        ids = tuple(block_tables[b][b0:b1])
        if len(ids) != b1 - b0:
            raise ValueError(f"sequence {b}: block table too short for {n} tokens")
        off = lo - b0 * bs
        # prompt chunks on CUDA read f16/bf16 keys as they are (flash_prefill), not a copy
        want = None if t > 1 and q.is_cuda and k_scales is None else q.dtype
        keys = _gather(k_cache, k_scales, ids, off, n - lo, want)  # [m, KV, D]
        vals = _gather(v_cache, v_scales, ids, off, n - lo, want)
        both = [(x - lo, y - lo) for x, y in spans[b]] if spans and spans[b] else None
        if t == 1:  # a lone query sees its span's keys causally (the span ends here)
            outs.append(_decode_one(q[s], keys, vals, scale, softcap, sinks))
        else:
            outs.append(_chunk(q[s:e], keys, vals, n - t - lo, scale, window, softcap, sinks,
                               both))  # fmt: skip
    return outs


def context_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` of one sequence whose context lives on the device (`BatchMeta.context`:
    `ctx` [2] int64, its first new position and its length after the step; `table` [W] int64,
    its block table, zero-padded): q [t, H, D], rows past ctx[1] - ctx[0] padding. On CUDA with
    plain float caches one kernel reads the blocks through the table (no host value depends on
    the context: a captured graph replays for any); elsewhere the reference reads them to the
    host and returns zeros for the padding rows."""
    if q.is_cuda and k_scales is None:
        from localllm.kernels.attention.triton_prefill import flash_prefill_paged, supports

        if supports(q, k_cache, v_cache):
            return flash_prefill_paged(q, k_cache, v_cache, table, ctx, scale, window, softcap,
                                       sinks)  # fmt: skip
    start, n = ctx.tolist()
    blocks = tuple(table[: -(-n // k_cache.shape[1])].tolist())
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    out[: n - start] = paged_attention(
        q[: n - start], k_cache, v_cache, (0, n - start), (n,), (blocks,), scale, window, softcap,
        k_scales, v_scales, sinks=sinks,
    )  # fmt: skip
    return out


def _with_plan(
    q,
    k_cache,
    v_cache,
    query_start,
    seq_lens,
    tables,
    scale,
    window,
    softcap,
    k_scales,
    v_scales,
    decode: DecodePlan,
    sinks: torch.Tensor | None = None,
    quant: "QuantizedX | None" = None,
    spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    shrink=None,
) -> torch.Tensor:
    """Single-token sequences in one batched pass; the others one by one into the same output."""
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    got = decode_attention(
        q, k_cache, v_cache, decode, scale, softcap, k_scales, v_scales, sinks, out, quant, shrink
    )
    if got is not out:  # the reference path returns the plan's rows only
        out[decode.rows] = got
    for b in range(len(seq_lens)):
        s, e = query_start[b], query_start[b + 1]
        if e - s > 1:
            out[s:e] = paged_attention(
                q[s:e],
                k_cache,
                v_cache,
                (0, e - s),
                (seq_lens[b],),
                (tables[b],),
                scale,
                window,
                softcap,
                k_scales,
                v_scales,
                sinks=sinks,
                spans=None if spans is None else (spans[b],),
            )
    return out


def _gather(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    ids: tuple[int, ...],
    off: int,
    m: int,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """Tokens off..off+m of the concatenated blocks `ids`, decoded to `dtype` (None: as stored,
    for unquantized caches): [m, KV, D]."""
    first = ids[0]
    if ids == tuple(range(first, first + len(ids))):  # consecutive ids: a view, no copy
        start = first * cache.shape[1] + off
        vals = cache.flatten(0, 1)[start : start + m]
        sc = None if scales is None else scales.flatten(0, 1)[start : start + m]
    else:
        index = torch.tensor(ids, dtype=torch.long, device=cache.device)
        vals = cache.index_select(0, index).flatten(0, 1)[off : off + m]
        sc = None if scales is None else scales.index_select(0, index).flatten(0, 1)[off : off + m]
    return vals if dtype is None or vals.dtype == dtype else decode_kv(vals, sc, dtype)


def _decode_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token: q [H, D] over keys/vals [m, KV, D] -> [1, H, Dv], heads grouped per KV.

    Two batched matmuls (batch = KV head) instead of SDPA's GQA path, which repeats K/V for every
    query head; decode on CPU is bound by per-op overhead.
    """
    kvh = keys.shape[1]
    qg = q.reshape(kvh, -1, q.shape[-1])  # [KV, G, D]
    scores = torch.bmm(qg, keys.permute(1, 2, 0)) * scale  # [KV, G, m]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(kvh, -1, 1))
    return torch.bmm(probs, vals.transpose(0, 1)).view(1, q.shape[0], -1)


def _chunk(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    q0: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    spans: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """t queries [t, H, D] at key offsets q0..q0+t-1 over keys/vals [m, KV, D] -> [t, H, Dv]."""
    if q.is_cuda:
        from localllm.kernels.attention.triton_prefill import flash_prefill, supports

        if supports(q, keys, vals):  # one launch instead of ~12
            return flash_prefill(q, keys, vals, q0, scale, window, softcap, sinks,
                                 spans=list(spans) if spans else None)  # fmt: skip
    return chunk_dense(q, keys, vals, q0, scale, window, softcap, sinks, spans)


def chunk_dense(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    q0: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    spans: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """`_chunk` in plain torch (a mask, then SDPA or matmul + softmax), keys of any float type;
    `spans`: key-index ranges [a, b) seen whole by the queries inside them."""
    keys, vals = keys.to(q.dtype), vals.to(q.dtype)  # gathered as stored on CUDA
    qb, kb, vb = q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1)
    mask = _mask(q0, q.shape[0], keys.shape[0], window, q.device, spans)
    if softcap is None and sinks is None:
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        group = qb.shape[0] // kb.shape[0]
        kb, vb = kb.repeat_interleave(group, 0), vb.repeat_interleave(group, 0)
        scores = (qb @ kb.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, -torch.inf)
        o = softmax_with_sinks(scores, None if sinks is None else sinks.view(-1, 1, 1)) @ vb
    return o.transpose(0, 1)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim, with `sinks` (broadcast to scores[..., :1]) as an extra logit
    whose probability is dropped: exp(s) / (sum exp(s) + exp(sink))."""
    if sinks is None:
        return scores.softmax(-1)
    total = torch.logaddexp(scores.logsumexp(-1, keepdim=True), sinks.to(scores.dtype))
    return torch.exp(scores - total)


def _mask(
    q0: int,
    t: int,
    m: int,
    window: int | None,
    device: torch.device,
    spans: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Boolean [t, m] (True = attend): key j is visible to query i if j <= q0 + i or both lie in
    one of `spans`, and (window) j > q0 + i - window: transformers' Gemma 3 rule, window AND
    (causal OR same image)."""
    keys = torch.arange(m, device=device)
    qpos = torch.arange(q0, q0 + t, device=device)
    mask = keys[None, :] <= qpos[:, None]
    for a, b in spans or ():
        inside_q = (qpos >= a) & (qpos < b)
        inside_k = (keys >= a) & (keys < b)
        mask |= inside_q[:, None] & inside_k[None, :]
    if window:
        mask &= keys[None, :] > qpos[:, None] - window
    return mask
