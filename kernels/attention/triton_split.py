"""Flash-decoding's split over each sequence's visible keys (`DecodePlan.span`), for long contexts.

The first split (`triton_decode._split_dot_kernel`) cut the plan's m keys into power-of-two
chunks fixed at launch: in a decode graph m is the table bucket's (up to twice the real length,
the rest padding that re-reads one key). At depth 8K (m 16,384) one sequence x 8 kv heads made
256 programs of 512-key chunks, half of them over padding, each a serial loop of 16 keys with
little of the cache in flight: 21 % of an H100's copy bandwidth. Here each (sequence, kv head)
has NS programs that split the sequence's own span, read on the device (a graph replays for any
length; padding is never read), NS set for several programs per SM, BJ keys a step, the slot
loads pipelined by tl.range (and, with AHEAD, the k/v loads a step ahead by hand).

"exact" products (the default) on f16/bf16 caches are float32 q and softmax weights cut into two
(f16) or three (bf16) parts in the cache's type, each part's product on tensor cores with float32
accumulation: about float32 products (each part is exact in 11 or 8 bits) for 2-3 passes over
keys that are read as they are, where tf32x3 converted every key to float32 and made three.

On a CPU (triton 3.9's interpreter, tests/kernels/test_flash_decode.py): decode-graph plans of
1-4 sequences over 3-700 keys with windows, softcap, empty splits, f16/f32 caches, against
`decode.decode_attention` in float64: within 2e-5, "native" 5e-3 (the interpreter's bfloat16
tl.dot is wrong). A torch emulation of the parts on one [16, 128] x [128, 64] product: f16 in two
parts 7.6e-7 off (one part 3.1e-3), bf16 in three parts exact in float64 (two 2.8e-5).
On an H100 (2026-12-06 12:18 UTC, triton 3.6, tests/perf/gpu_flashdecode.sh; tests/perf/results/
gpu-kernels.md): test_flash_decode.py's GPU tests passed (at 8 warps, then the default); graph
replay vs eager decode (tests/engine/test_gpu_graphs.py) failed, 9 of 24,576 logits over 0.02
(max 0.032), cause not isolated (tests/perf/graph_replay_diff.py). 8B shape, f16, exact: one
sequence at 8K keys 27.0 us a layer at 8 warps, 20.7 at 4 (67 % of the copy bandwidth; the chunk
split 56.0); at 4 warps 32K 56.5 us (97 %), 64 sequences x 2K 193 us. tg128 at depth 8K / 32K
1.41x / 1.36x llama-bench.
"""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl
from localllm.kernels.attention.decode_plan import DecodePlan

# The launch (each overridable by `split_span`'s `tune`, as tests/perf/bench_attention.py sweeps).
# ptxas for sm_90 (triton 3.9, f16 keys, D 128, exact): 32 keys a step at 8 warps take 128
# registers a thread without spills (two programs per SM), with AHEAD 186 (one; 80 B spilled at a
# cap of 128); 64 keys spill at 4 warps. ptxas takes up to 255 unless capped (`maxnreg`).
TUNE = {
    "programs": 528,  # (sequence, kv head, split) programs aimed for: four per SM of an H100
    "key_values": 4096,  # values of the keys one step loads (BJ x head dim): 32 keys of 128
    "warps": 4,  # the H100 sweep's fastest (12:19 UTC 2026-12-06; 8 warps 1.2-1.6x slower)
    "stages": 2,  # tl.range's pipelining stages: triton prefetches the slot loads, not k/v
    "ahead": False,  # issue the next step's k/v loads before this step's math (by hand)
    "maxnreg": None,  # a register cap (more programs per SM), None: ptxas's choice
}


@triton.jit
def _dot_parts(a, b, NT: tl.constexpr):
    """a (float32) @ b: NT = 0: b float32 in three tf32 passes; else a cut into NT parts in b's
    type (1: a rounded, llama.cpp's flash attention; 2-3: ~float32), float32 accumulation."""
    if NT == 0:
        return tl.dot(a, b, input_precision="tf32x3")
    hi = a.to(b.dtype)
    out = tl.dot(hi, b)
    if NT >= 2:
        rest = a - hi.to(tl.float32)
        mid = rest.to(b.dtype)
        out = tl.dot(mid, b, out)
        if NT >= 3:
            out = tl.dot((rest - mid.to(tl.float32)).to(b.dtype), b, out)
    return out


@triton.jit
def _slots(slots_ptr, pad_ptr, srow, j, end, HAS_PAD: tl.constexpr):
    """The cache slots of plan positions j (< end), and which of them count."""
    ok = j < end
    slot = tl.load(slots_ptr + srow + j, mask=ok, other=0)
    if HAS_PAD:
        ok &= tl.load(pad_ptr + srow + j, mask=ok, other=1) == 0
    return slot, ok


@triton.jit
def _kv(k_ptr, v_ptr, slot, ok, g, d, dv, KV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr):
    """kv head g's keys and values at those slots (zeros where not ok)."""
    base = slot * KV + g
    k = tl.load(k_ptr + base[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    v = tl.load(v_ptr + base[:, None] * DV + dv[None, :], mask=ok[:, None], other=0.0)
    return k, v


@triton.jit
def _span_split_kernel(
    q_ptr, rows_ptr, k_ptr, v_ptr, slots_ptr, pad_ptr, span_ptr, m_ptr, l_ptr, acc_ptr,
    M, NS, scale, softcap,
    KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GH: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, BJ: tl.constexpr, HAS_PAD: tl.constexpr, HAS_SPAN: tl.constexpr,
    CAP: tl.constexpr, NT: tl.constexpr, STAGES: tl.constexpr, AHEAD: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program (b, g, c): split c of NS of sequence b's keys [lo, hi) (span, else [0, M) with
    `pad` masking) for kv head g's query heads (padded to GH >= 16 rows for tl.dot); writes the
    running max, denominator and unnormalized sum for `triton_decode._combine_kernel`."""
    pdl.gdc_begin(PDL)
    pdl.gdc_wait(PDL)
    b, g, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    gi = tl.arange(0, GH)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    row = tl.load(rows_ptr + b)
    qo = (row * KV * G + g * G + gi)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + qo, mask=(gi < G)[:, None], other=0.0).to(tl.float32) * scale
    if HAS_SPAN:
        lo = tl.load(span_ptr + 2 * b).to(tl.int32)
        hi = tl.load(span_ptr + 2 * b + 1).to(tl.int32)
    else:  # (tensors: M may come specialized as a constant)
        lo = b * 0
        hi = lo + M
    per = tl.cdiv(tl.cdiv(hi - lo, NS), BJ) * BJ  # whole steps: only the span's end is masked
    start = lo + c * per
    end = tl.minimum(start + per, hi)
    mx = tl.full([GH], float("-inf"), tl.float32)
    den = tl.zeros([GH], dtype=tl.float32)
    acc = tl.zeros([GH, DV], dtype=tl.float32)
    srow = b.to(tl.int64) * M
    jb = tl.arange(0, BJ)
    if AHEAD:  # step i issues step i + 1's k/v loads (from slots loaded a step earlier) and step
        # i + 2's slot loads before its own math: no load waits on another within a step
        slot, ok = _slots(slots_ptr, pad_ptr, srow, start + jb, end, HAS_PAD)
        k, v = _kv(k_ptr, v_ptr, slot, ok, g, d, dv, KV, D, DV)
        slot1, ok1 = _slots(slots_ptr, pad_ptr, srow, start + BJ + jb, end, HAS_PAD)
    for j0 in tl.range(start, end, BJ, num_stages=STAGES):
        if AHEAD:
            kn, vn = _kv(k_ptr, v_ptr, slot1, ok1, g, d, dv, KV, D, DV)
            slot2, ok2 = _slots(slots_ptr, pad_ptr, srow, j0 + 2 * BJ + jb, end, HAS_PAD)
        else:
            slot, ok = _slots(slots_ptr, pad_ptr, srow, j0 + jb, end, HAS_PAD)
            k, v = _kv(k_ptr, v_ptr, slot, ok, g, d, dv, KV, D, DV)
        s = _dot_parts(q, tl.trans(k), NT)  # [GH, BJ]
        if CAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # cap * tanh(s / cap)
        s = tl.where(ok[None, :], s, float("-inf"))
        new = tl.maximum(mx, tl.max(s, axis=1))
        safe = tl.where(new == float("-inf"), 0.0, new)  # nothing seen yet: no NaN
        p = tl.exp(s - safe[:, None])
        alpha = tl.exp(mx - safe)
        acc = acc * alpha[:, None] + _dot_parts(p, v, NT)
        den = den * alpha + tl.sum(p, axis=1)
        mx = new
        if AHEAD:
            k, v, ok, slot1, ok1 = kn, vn, ok1, slot2, ok2
    part = (b * KV + g) * NS + c
    keep = gi < GP  # the partials are laid out for GP heads per group
    tl.store(m_ptr + part * GP + gi, mx, mask=keep)
    tl.store(l_ptr + part * GP + gi, den, mask=keep)
    tl.store(acc_ptr + (part * GP + gi)[:, None] * DV + dv[None, :], acc, mask=keep[:, None])


def parts(dot: str, dtype: torch.dtype) -> int:
    """`_dot_parts`'s NT for a `flash_decode` precision and the cache's type."""
    if dot == "native":
        return 1
    return {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}[dtype]


def split_span(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    softcap: float | None,
    dot: str,
    launch: dict,
    tune: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The partials (max, denominator, sum [nd * KV * NS * GP (, Dv)]) and NS for
    `triton_decode._combine_kernel`. `tune`: `TUNE` keys to override, and "bj" (keys a step)."""
    nd, m = plan.slots.shape
    _, _, kvh, d = k_cache.shape
    dv = v_cache.shape[-1]
    g = q.shape[1] // kvh
    gp = triton.next_power_of_2(g)
    t = TUNE | {k: v for k, v in (tune or {}).items() if v is not None}
    bj = t.get("bj") or min(128, max(16, 1 << ((t["key_values"] // max(d, dv)).bit_length() - 1)))
    # splits: enough for `programs` in all, none shorter than a step of the longest possible span
    ns = max(1, min(triton.cdiv(m, bj), triton.cdiv(t["programs"], nd * kvh)))
    dev = q.device
    mx = torch.empty(nd * kvh * ns * gp, dtype=torch.float32, device=dev)
    den = torch.empty_like(mx)
    acc = torch.empty(nd * kvh * ns * gp, dv, dtype=torch.float32, device=dev)
    slots = plan.slots.contiguous()
    pad = plan.pad.reshape(nd, m).contiguous() if plan.pad is not None else slots
    span = plan.span.contiguous() if plan.span is not None else slots
    geo = {"KV": kvh, "G": g, "GP": gp, "GH": max(16, gp), "D": d, "DV": dv, "BJ": bj}
    has_span = plan.span is not None  # the span holds every visible key: no pad to read
    flags = {"HAS_PAD": plan.pad is not None and not has_span, "HAS_SPAN": has_span}
    flags |= {"CAP": softcap is not None, "NT": parts(dot, k_cache.dtype)}
    flags |= {"STAGES": t["stages"], "AHEAD": bool(t["ahead"]), "num_warps": t["warps"]}
    if t["maxnreg"]:
        flags["maxnreg"] = t["maxnreg"]
    _span_split_kernel[(nd, kvh, ns)](
        q.contiguous(), plan.rows, k_cache, v_cache, slots, pad, span, mx, den, acc,
        m, ns, scale, softcap or 0.0, **geo, **flags, **launch,
    )  # fmt: skip
    return mx, den, acc, ns
