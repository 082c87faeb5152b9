"""MoE prefill on CUDA, one Qwen3-30B-A3B-shaped layer (128 experts, 8 used, dim 2048, hidden
768; Q4_K gate/up, Q6_K or Q4_K down, random blocks): the grouped int8 tensor-core GEMMs over
packed blocks (`kernels.moe.grouped`) against the previous path (experts expanded to bf16, torch
grouped GEMMs), a launch-geometry sweep of each GEMM, and whether a pair's bits depend on the row
block size. Run on the H200: `python3 tests/perf/bench_moe_prefill.py [--tokens 128,512,2048]`.
End to end, `expanded` can replace `packed._prefill` for an A/B of `localllm bench`.
"""

import argparse
import itertools

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from localllm.kernels.moe import ExpertFormat, packed, route_topk
from localllm.kernels.moe.grouped import GroupedConfig, grouped_gemm
from localllm.kernels.moe.pairs import block_rows, sort_pairs
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.triton_packed import dequantize_experts_t, quantize_x8
from tests.perf.make_synthetic import random_rows

E, K_USED, D, H = 128, 8, 2048, 768


def _stack(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.stack([random_rows(QT[name], rows, cols, rng) for _ in range(E)]))


def expanded(x, weights, ids, pe, fmt):
    """The previous prefill (until 2026-12-01): experts expanded to bf16 in chunks of 512 MiB,
    torch grouped GEMMs, one host sync per layer for the chunks' row ranges."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    n_expert = pe.n_expert
    order = torch.argsort(flat, stable=True)
    ends = torch.bincount(flat, minlength=n_expert).cumsum(0)
    xs = x.float()[order // k]
    chunk = max(1, (512 << 20) // (2 * fmt.dim * fmt.hidden * 3))
    bounds = [0, *ends.tolist()]
    ys = torch.empty(t * k, fmt.dim, dtype=torch.float32, device=x.device)

    def mm(a, w, offs):
        return torch._grouped_mm(a, w, offs=offs).float()

    for e0 in range(0, n_expert, chunk):
        e1 = min(n_expert, e0 + chunk)
        r0, r1 = bounds[e0], bounds[e1]
        if r1 > r0:
            offs = (ends[e0:e1] - r0).to(torch.int32)
            xb = xs[r0:r1].to(torch.bfloat16)
            parts = [mm(xb, dequantize_experts_t(p, e0, e1), offs) for p in pe.gate_up]
            h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            a = packed._act(h, fmt).to(torch.bfloat16)
            ys[r0:r1] = mm(a, dequantize_experts_t(pe.down, e0, e1), offs)
    y = torch.empty_like(ys)
    y[order] = ys
    return packed.combine(y, weights)


def _time(fn, reps: int = 20) -> float:
    """Median milliseconds of `reps` calls after two warm-ups."""
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="128,512,2048")
    ap.add_argument("--down", default="Q6_K,Q4_K")
    ap.add_argument(
        "--sweep", type=int, default=512, help="tokens for the geometry sweep (0: none)"
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    gate, up = _stack("Q4_K", H, D, 1).to(dev), _stack("Q4_K", H, D, 2).to(dev)
    for down_t in args.down.split(","):
        down = _stack(down_t, D, H, 3).to(dev)
        fmt = ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType[down_t], D, H)
        pe = packed.pack_experts(gate, up, down, fmt, K_USED)
        wbytes = pe.nbytes
        print(f"\n## down {down_t}: layer experts {wbytes / 2**20:.1f} MiB packed")
        print("| tokens | bm | expanded ms | grouped ms | speed-up | rel diff |")
        print("|---:|---:|---:|---:|---:|---:|")
        for t in (int(v) for v in args.tokens.split(",")):
            gen = torch.Generator(device=dev).manual_seed(t)
            x = torch.randn(t, D, device=dev, generator=gen)
            w, ids = route_topk(torch.randn(t, E, device=dev, generator=gen), K_USED, True)

            def old(x=x, w=w, ids=ids, pe=pe, fmt=fmt):
                return expanded(x, w, ids, pe, fmt)

            def new(x=x, w=w, ids=ids, pe=pe, fmt=fmt):
                return packed._prefill(x, w, ids, pe, fmt)

            a, b = old(), new()
            to, tn = _time(old), _time(new)
            bm = block_rows(t * K_USED, E)
            print(f"| {t} | {bm} | {to:.3f} | {tn:.3f} | {to / tn:.2f}x | {_rel(b, a):.2e} |")
            outs = {}
            for bm in (16, 32, 64):  # the same pairs with each row block size
                sp = sort_pairs(ids, E, bm)
                outs[bm] = packed.ffn_sorted(x, sp, K_USED, pe, fmt)
            same = [torch.equal(outs[16], outs[m]) for m in (32, 64)]
            print(f"|   bits equal across bm 16/32/64: {same} |")
        if args.sweep and down_t == args.down.split(",")[0]:
            _sweep(pe, fmt, args.sweep, dev)


def _sweep(pe, fmt, t: int, dev) -> None:
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, D, device=dev, generator=gen)
    _, ids = route_topk(torch.randn(t, E, device=dev, generator=gen), K_USED, True)
    act = torch.randn(t * K_USED, H, device=dev, generator=gen)
    jobs = (
        ("gate_up", quantize_x8(x), pe.gate_up[0], K_USED),
        ("down", quantize_x8(act), pe.down, 1),
    )
    for name, a, p, adiv in jobs:
        flops = 2 * t * K_USED * p.n * p.k
        rows = []
        geos = itertools.product((16, 64, 128), (64, 128, 256), (4, 8), (3,))
        for bm, bn, warps, stages in geos:
            sp = sort_pairs(ids, E, bm)
            cfg = GroupedConfig(bn, warps, stages)
            try:
                call = (a, sp, p, adiv, cfg)
                ms = _time(lambda call=call: grouped_gemm(*call), 10)
            except Exception as exc:  # a geometry the compiler rejects (registers, shared memory)
                print(f"{name} bm {bm} bn {bn} w {warps} s {stages}: {type(exc).__name__}")
                continue
            rows.append((ms, bm, bn, warps, stages))
        rows.sort()
        print(f"\n{name} {p.qtype.name} N {p.n} K {p.k}, {t} tokens: best 6 of {len(rows)}")
        for ms, bm, bn, warps, stages in rows[:6]:
            tf = flops / ms / 1e9
            geo = f"bm {bm:3d} bn {bn:3d} warps {warps} stages {stages}"
            print(f"  {geo}: {ms:.3f} ms {tf:.0f} TFLOPS")
        base = [r for r in rows if r[1:] == (block_rows(t * K_USED, E), 128, 4, 3)]
        if base:
            print(f"  default: {base[0][0]:.3f} ms")


if __name__ == "__main__":
    main()
