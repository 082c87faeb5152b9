"""GPU time of one 8B decode step's base GEMVs with and without LoRA, per scheme (issue 36). Not a
test.

One step of a Llama-3-8B-shaped Q4_K_M model has 32 layers x 4 adapted call sites: q|k|v (one
Q4_K GEMV of 6,144 rows: q 4,096, k and v 1,024 each), o (Q4_K 4,096), gate|up (Q4_K 28,672) and
down (Q6_K 4,096 x 14,336). This captures those 128 packed dp4a GEMVs (random blocks, the
activations quantized once outside the graph, as the norms' fused kernels hand them over) in one
CUDA graph, with each LoRA scheme's work around them, and prints microseconds per replayed step:

- base: the GEMVs alone;
- atomic: GEMV, then `triton_lora.shrink_expand` (the default scheme: shrink + expand launches);
- epilogue: `triton_lora.shrink`, then the GEMV with the expand in its epilogue
  (`engine.lora.delta.SCHEME = "epilogue"`);
- inline: the GEMV alone, doing the shrink's items in its first programs and the expand in its
  epilogue (SCHEME "inline": no LoRA launch; as in the engine, a site whose shrink has more
  items than the GPU has SMs launches it: four adapters' q|k|v and down).

Rank-16 adapters (float16), 1 and 4 of them on every part, 1 and 4 rows; the overhead column is
against base. No attention, norms or sampling between the GEMVs: a real step is ~15 % longer, so
its relative overhead is somewhat smaller. Before timing, each scheme's outputs are checked
against the torch reference (max |diff| printed).

    python tests/perf/bench_lora_epilogue.py [--reps 30] [--layers 32] [--weights 2]
"""

import argparse
import dataclasses

import torch

from localllm.engine.lora.delta import inline_items_cap
from localllm.kernels.fused import triton_lora
from localllm.kernels.fused.lora_delta import LoraPart, make_tail, scratch
from localllm.kernels.quant import QuantType, block_geometry
from localllm.kernels.quant.repack import pack_blocks
from localllm.kernels.quant.triton_lora_tail import shrink_items
from localllm.kernels.quant.triton_packed import (
    gemv_packed,
    packed_config,
    quantize_x8,
    split_counters,
)

# (type, in, part outputs) of the 8B shape's four adapted call sites
SITES = [
    (QuantType.Q4_K, 4096, [4096, 1024, 1024]),
    (QuantType.Q4_K, 4096, [4096]),
    (QuantType.Q4_K, 4096, [14336, 14336]),
    (QuantType.Q6_K, 14336, [4096]),
]
SCALE_BYTES = {QuantType.Q4_K: (0, 4), QuantType.Q6_K: (208, 210)}  # fp16 d (and dmin)
SCHEMES = ("base", "atomic", "epilogue", "inline")


def _weight(qtype: QuantType, n: int, k: int, g: torch.Generator):
    """Random blocks on the GPU with small finite fp16 scales, packed."""
    block, nbytes = block_geometry(qtype)
    raw = torch.randint(0, 256, (n, k // block, nbytes), dtype=torch.uint8, device="cuda",
                        generator=g)  # fmt: skip
    a, b = SCALE_BYTES[qtype]
    halves = (b - a) // 2
    d = (1e-3 * torch.rand(n, k // block, halves, device="cuda", generator=g)).half()
    raw[:, :, a:b] = d.view(torch.uint8).reshape(n, k // block, b - a)
    p = pack_blocks(raw.reshape(n, -1), qtype, n, k)
    cfg = packed_config(qtype, n, k)
    return p, cfg


class Site:
    """One call site: its packed weight (shared across layers), adapters, scratch and tail."""

    def __init__(self, weight, k, outs, adapters, rank, rows, g):
        self.p, self.cfg = weight
        r_part = adapters * rank
        self.a = (0.02 * torch.randn(r_part * len(outs), k, device="cuda", generator=g)).half()
        self.parts = [
            LoraPart(i * r_part, (i + 1) * r_part,
                     (0.02 * torch.randn(r_part, n, device="cuda", generator=g)).half())
            for i, n in enumerate(outs)
        ]  # fmt: skip
        self.w = torch.ones(64, self.a.shape[0], device="cuda")
        self.x = torch.randn(rows, k, device="cuda", generator=g)
        self.xq = quantize_x8(self.x)
        self.outs = outs
        self.pad = scratch(self.a.shape[0], "cuda")
        self.counters = split_counters(self.p, self.cfg)
        tiles = -(-sum(outs) // self.cfg.block_n)
        self.tail = make_tail(self.pad, [(n, p) for n, p in zip(outs, self.parts, strict=True)],
                              tiles)  # fmt: skip
        # as the engine: the shrink launched where its items would outnumber the SMs
        inline = shrink_items(*self.a.shape) <= inline_items_cap(self.a.device)
        self.inline = dataclasses.replace(self.tail, a=self.a, w=self.w) if inline else None

    def call(self, scheme: str) -> torch.Tensor:
        if scheme == "inline" and self.inline is not None:
            return gemv_packed(self.x, self.p, self.cfg, self.counters, self.xq, self.inline)
        if scheme == "inline":
            scheme = "epilogue"
        if scheme == "epilogue":
            triton_lora.shrink(self.x, self.a, self.w, self.pad)
            return gemv_packed(self.x, self.p, self.cfg, self.counters, self.xq, self.tail)
        y = gemv_packed(self.x, self.p, self.cfg, self.counters, self.xq)
        if scheme == "atomic":
            triton_lora.shrink_expand(self.x, self.a, self.w, self.parts,
                                      list(y.split(self.outs, dim=1)), self.pad)  # fmt: skip
        return y


def step_us(scheme: str, sites: list[Site], reps: int) -> float:
    for s in sites:  # compile and warm outside the capture
        s.call(scheme)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in sites:
            s.call(scheme)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps


def check(sites: list[Site]) -> float:
    """The largest |difference| of the LoRA schemes from base + the torch reference's delta."""
    worst = 0.0
    for s in sites[:4]:
        base = s.call("base")
        t = (s.x.float() @ s.a.float().T) * s.w[: s.x.shape[0]]
        want = base.clone()
        c0 = 0
        for p, n in zip(s.parts, s.outs, strict=True):
            want[:, c0 : c0 + n] += t[:, p.lo : p.hi] @ p.b_t.float()
            c0 += n
        for scheme in ("atomic", "epilogue", "inline"):
            got = s.call(scheme)
            worst = max(worst, (got - want).abs().max().item())
            if s.pad[0].any() or s.pad[1].any():
                raise RuntimeError(f"{scheme}: the scratch was left dirty")
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--weights", type=int, default=2, help="distinct layer weight sets (cycled)")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated: {SCHEMES}")
    a = ap.parse_args()
    schemes = [s for s in a.schemes.split(",") if s in SCHEMES]
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [[_weight(qt, sum(outs), k, g) for qt, k, outs in SITES] for _ in range(a.weights)]
    print(f"{torch.cuda.get_device_name()}: {a.layers} layers x {len(SITES)} call sites, rank "
          f"{a.rank}, microseconds per step (overhead against base)\n")  # fmt: skip
    print(f"| adapters | rows | {' | '.join(schemes)} | max diff |")
    print("|---:|---:|" + "---:|" * (len(schemes) + 1))
    for adapters in (1, 4):
        for rows in (1, 4):
            sites = [Site(weights[i % a.weights][j], k, outs, adapters, a.rank, rows, g)
                     for i in range(a.layers) for j, (_, k, outs) in enumerate(SITES)]  # fmt: skip
            diff = check(sites)
            us = {s: step_us(s, sites, a.reps) for s in schemes}
            base = us.get("base")
            cells = [f"{v:.0f}" + (f" (+{100 * (v / base - 1):.1f} %)" if base and s != "base"
                     else "") for s, v in us.items()]  # fmt: skip
            print(f"| {adapters} | {rows} | {' | '.join(cells)} | {diff:.1e} |")


if __name__ == "__main__":
    main()
