"""Flash-decoding on a GPU: the chunk split against the span split, and the span split's launch
(run there; not a test).

    python tests/perf/bench_attention.py [--sweep] [--best FILE.json] [--cases 1x512,16x2048]

For the Llama-3-8B attention shape (32 q / 8 kv heads of 128, f16 cache, 16-key pages over
shuffled blocks), each case is nd sequences at a decode depth, planned as a decode graph plans it
(`padded_decode_plan`: m the table bucket, up to twice the real length): the GPU time of
`flash_decode` (split + combine) per call from CUDA-graph replays, cycling over enough layer
caches (>= 256 MiB) that the keys come from memory, not L2; GB/s = the real keys' and values'
bytes over that time, next to a device-to-device copy's. Variants: "chunk" (the previous split
over all m keys, tf32x3), "span" (`triton_split` at its `TUNE`), "span native" (f16 products),
and with --sweep the span split's launch grid. Each is checked against the plain-torch reference
first. --best writes the swept launch with the least summed time (the decode step's cases).
"""

import argparse
import json
import math

import torch

from localllm.kernels.attention.decode import decode_attention
from localllm.kernels.attention.decode_graph import PaddedPositions, padded_decode_plan
from localllm.kernels.attention.triton_decode import flash_decode
from localllm.kernels.attention.triton_split import TUNE

H, KVH, D, BS = 32, 8, 128, 16
CASES = "1x192,1x512,1x4096,1x8192,1x32768,16x2048,64x1024,64x2048"  # sequences x decode depth
TG = 64  # keys past the depth: the middle of a tg128 run
# the span split's launches swept: (keys a step, warps, ahead, register cap, programs); stages 2
SWEEP = [
    (32, 4, False, None, None), (32, 4, False, 128, None), (32, 4, False, 128, 1056),
    (32, 4, True, None, None), (32, 4, True, 168, None), (32, 8, False, 96, None),
    (32, 8, False, 80, None), (32, 8, True, None, None), (32, 8, True, 128, None),
    (64, 8, False, None, None), (64, 8, False, 128, None), (64, 8, True, None, None),
    (16, 4, False, None, None),
]  # fmt: skip
PROGRAMS = (264, 528, 1056)  # swept at the default launch


def _time(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    e0.record()
    g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / reps


def copy_gbs() -> float:
    """Device-to-device copy bandwidth (read + write bytes), 1 GiB."""
    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _time(lambda: b.copy_(a), reps=10) / 1e3


class Case:
    """nd sequences of depth + TG keys (batches: depths spread over the last quarter), their
    layer caches and the graph plan."""

    def __init__(self, nd: int, depth: int, gen: torch.Generator):
        lens = [depth + TG - (i * depth // (4 * nd) if nd > 1 else 0) for i in range(nd)]
        width = 16
        while width * BS < max(lens):
            width *= 2
        self.nd, self.depth, self.real = nd, depth, sum(lens)
        blocks = nd * width
        per_layer = blocks * BS * KVH * D * 2 * 2
        self.layers = max(1, min(64, math.ceil((256 << 20) / per_layer)))
        shape = (blocks, BS, KVH, D)
        self.caches = [
            (torch.randn(shape, device="cuda", dtype=torch.float16),
             torch.randn(shape, device="cuda", dtype=torch.float16))
            for _ in range(self.layers)
        ]  # fmt: skip
        tables = torch.randperm(blocks, generator=gen).view(nd, width).cuda()
        where = PaddedPositions.make(width, BS, "cuda")
        self.plan = padded_decode_plan(tables, torch.tensor(lens).cuda(), where, BS)
        self.q = torch.randn(nd, H, D, generator=gen).cuda()
        kc, vc = self.caches[0]
        self.ref = decode_attention(self.q.double(), kc.double(), vc.double(), self.plan, D**-0.5)
        self.bytes = self.real * KVH * D * 2 * 2

    @property
    def name(self) -> str:
        return f"{self.nd}x{self.depth}"

    def run(self, **kw) -> tuple[float, float]:
        """(us per call, max error) of flash_decode with these arguments."""
        kc, vc = self.caches[0]
        err = (flash_decode(self.q, kc, vc, self.plan, D**-0.5, **kw).double() - self.ref).abs()
        calls = [(k, v) for k, v in self.caches]

        def step():
            for k, v in calls:
                flash_decode(self.q, k, v, self.plan, D**-0.5, **kw)

        return _time(step, reps=max(2, 64 // self.layers)) / self.layers, err.max().item()


def variants(sweep: bool) -> list[tuple[str, dict]]:
    out = [
        ("chunk exact", {"kernel": "chunk", "dot": "exact"}),
        ("span exact", {"kernel": "span", "dot": "exact"}),
        ("span native", {"kernel": "span", "dot": "native"}),
    ]
    if sweep:
        for bj, warps, ahead, reg, programs in SWEEP:
            tune = {"ahead": ahead, "maxnreg": reg, "programs": programs}
            label = f"sweep bj{bj} w{warps} a{int(ahead)} r{reg or '-'} p{programs or '-'}"
            out.append((label, {"kernel": "span", "bj": bj, "warps": warps, "tune": tune}))
        for p in PROGRAMS:
            out.append((f"sweep programs {p}", {"kernel": "span", "tune": {"programs": p}}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--best", help="write the fastest swept launch here (JSON)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    copy = copy_gbs()
    print(f"copy bandwidth {copy:.0f} GB/s; span TUNE {TUNE}")
    print("| case | m (real keys) | variant | us per layer | GB/s | % copy | max err |")
    print("|---|---|---|---:|---:|---:|---:|")
    totals: dict[str, float] = {}
    picks: dict[str, dict] = {}
    for spec in args.cases.split(","):
        nd, depth = (int(x) for x in spec.split("x"))
        case = Case(nd, depth, gen)
        m = case.plan.slots.shape[1]
        for label, kw in variants(args.sweep):
            try:
                us, err = case.run(**kw)
            except Exception as e:  # a launch that does not compile or fit: say so, go on
                print(f"| {case.name} | {m} | {label} | failed: {type(e).__name__} | | | |")
                totals[label] = math.inf
                continue
            gbs = case.bytes / us / 1e3
            print(f"| {case.name} | {m} ({case.real}) | {label} | {us:.1f} | {gbs:.0f} | "
                  f"{100 * gbs / copy:.0f} | {err:.1e} |")  # fmt: skip
            if err > 1e-4 and "native" not in label:
                totals[label] = math.inf  # wrong: never the pick
            totals[label] = totals.get(label, 0.0) + us
            picks[label] = kw
        del case
        torch.cuda.empty_cache()
    span = ("span exact", "sweep")  # the candidates for the span split's exact launch
    ranked = sorted((t, lbl) for lbl, t in totals.items() if lbl.startswith(span))
    others = [f"{lbl} {t:.1f}" for lbl, t in totals.items() if not lbl.startswith(span)]
    print("summed us over the cases: " + "; ".join(others))
    print("span launches, fastest first: " + "; ".join(f"{lbl} {t:.1f}" for t, lbl in ranked[:6]))
    if args.best and ranked:
        kw = picks[ranked[0][1]]
        best = {k: v for k, v in kw.get("tune", {}).items() if v is not None}
        best |= {k: kw[k] for k in ("bj", "warps") if k in kw}
        with open(args.best, "w") as f:
            json.dump({"label": ranked[0][1], "tune": best}, f)
        print(f"best: {ranked[0][1]} -> {best}")


if __name__ == "__main__":
    main()
