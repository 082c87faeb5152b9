"""GPU measurements for tests/perf/results/gpu-kernels.md (run on the H200; not a test).

    python tests/perf/bench_gpu.py kernels          # each GEMV / prefill dequant vs its byte floor
    python tests/perf/bench_gpu.py packed [moe]     # dp4a GEMVs over packed blocks: geometry sweep
    python tests/perf/bench_gpu.py packed pipe      # the 8B's Q4_K / Q6_K GEMVs: cp.async stages
                                                    # x programs per launch (GEMV_STAGES)
    python tests/perf/bench_gpu.py breakdown MODEL  # one decode step: time per op vs byte floor

Byte floors use the measured copy bandwidth of the H200 here (4.25 TB/s, bytes read + written).
"""

import sys
from collections import defaultdict

import torch

COPY_BW = 4.25e12
# Llama-3.1-8B linear shapes (N, K) per layer, fused as the engine runs them
LLAMA8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# Qwen3-30B-A3B's attention projections and head (`packed moe`): q+k and v are two weights of one
# fused launch where v is Q6_K (Q4_K_M's "more bits" layers)
QWEN3MOE = {"qkv": (5120, 2048), "qk": (4608, 2048), "v": (512, 2048), "o": (2048, 4096)}


def _blocks(qtype, n: int, k: int) -> torch.Tensor:
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    from tests.perf.make_synthetic import random_rows

    return torch.from_numpy(random_rows(QT(int(qtype)), n, k, np.random.default_rng(0)))


def _row(label: str, name: str, shape: str, m, fn, nbytes: int) -> None:
    from triton.testing import do_bench

    ms = do_bench(fn, warmup=20, rep=100)
    gbs = nbytes / ms / 1e6
    pct = 100 * gbs * 1e9 / COPY_BW
    print(f"| {label} | {name} | {shape} | {m} | {ms * 1e3:.1f} | {gbs:.0f} | {pct:.0f} |")


def kernels() -> None:
    from functools import partial

    from localllm.kernels.quant import QuantType
    from localllm.kernels.quant.triton_linear import dequantize_bf16, gemv

    print("| kernel | type | N x K | M | us | GB/s | % of 4.25 TB/s |")
    print("|---|---|---|---|---:|---:|---:|")
    shapes = [*LLAMA8B.items(), ("output", (128256, 4096))]
    for name in ("Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0"):
        qt = QuantType[name]
        for label, (n, k) in shapes:
            data = _blocks(qt, n, k).cuda()
            for m in (1, 4):
                x = torch.randn(m, k, device="cuda")
                fn = partial(gemv, x, data, qt, n, k)
                _row(f"gemv {label}", name, f"{n}x{k}", m, fn, data.numel() + 4 * m * (k + n))
            fn = partial(dequantize_bf16, data, qt, n, k)
            _row(f"dequant {label}", name, f"{n}x{k}", "-", fn, data.numel() + 2 * n * k)
            torch.cuda.empty_cache()


def sweep() -> None:
    """GEMV launch geometries at M = 1, each checked against the torch reference first."""
    from functools import partial

    from triton.testing import do_bench

    from localllm.kernels.quant import QuantType, dequantize
    from localllm.kernels.quant.triton_linear import GemvConfig, gemv, gemv_config

    print("| type | N x K | block_n | step | warps | us | % of 4.25 TB/s | default |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for name, steps in (("Q4_K", (1, 2, 4)), ("Q6_K", (1,)), ("Q8_0", (4, 8, 16))):
        qt = QuantType[name]
        for n, k in (LLAMA8B["gate_up"], LLAMA8B["down"]):
            data = _blocks(qt, n, k).cuda()
            x = torch.randn(1, k, device="cuda")
            ref = (x.double() @ dequantize(data, qt).reshape(n, k).double().T).float()
            best = None
            for bn in (4, 8, 16, 32):
                for step in steps:
                    for warps in (2, 4, 8):
                        cfg = GemvConfig(bn, step, warps)
                        y = gemv(x, data, qt, n, k, cfg)
                        if not ((y - ref).norm() / ref.norm()).item() < 1e-5:
                            print(f"| {name} | {n}x{k} | {bn} | {step} | {warps} | WRONG | | |")
                            continue
                        us = do_bench(partial(gemv, x, data, qt, n, k, cfg), warmup=10, rep=40)
                        us *= 1e3
                        pct = 100 * data.numel() / (us * 1e-6) / COPY_BW
                        mark = "yes" if cfg == gemv_config(qt, n) else ""
                        if best is None or us < best[0]:
                            best = (us, cfg)
                        print(f"| {name} | {n}x{k} | {bn} | {step} | {warps} | {us:.1f} | "
                              f"{pct:.0f} | {mark} |")  # fmt: skip
            print(f"best {name} {n}x{k}: {best}")


def packed(model: str = "llama8b") -> None:
    """dp4a GEMVs over packed Q4_K / Q6_K / Q8_0 (activation quantization included): rows per
    program x warps x split-K target at M = 1, each first checked against the q8x reference, timed
    as CUDA-graph replays (GPU time; the host's launch cost is what graphs remove in decode).
    "pipe": the 8B's Q4_K and Q6_K shapes, 64 or 128 rows and one warp a program, 132 to 2,112
    programs, the loop over a program's blocks in 1 (plain loads), 2 or 3 cp.async stages."""
    from functools import partial

    from triton.testing import do_bench_cudagraph

    from localllm.kernels.quant import QuantType
    from localllm.kernels.quant.dequant import dequantize
    from localllm.kernels.quant.q8x_reference import quantize_x8_reference
    from localllm.kernels.quant.repack import pack_blocks
    from localllm.kernels.quant.triton_packed import (
        PackedConfig,
        gemv_packed,
        packed_config,
        split_counters,
    )

    cases = [
        *(("Q4_K", "gate_up"), ("Q4_K", "down"), ("Q4_K", "qkv"), ("Q4_K", "o")),
        *(("Q6_K", "down"), ("Q6_K", "output"), ("Q8_0", "gate_up"), ("Q8_0", "down")),
        *(("Q8_0", "qkv"), ("Q8_0", "o")),
    ]
    shapes = {**LLAMA8B, "output": (128256, 4096)}
    if model == "moe":
        cases = [("Q4_K", "qkv"), ("Q4_K", "qk"), ("Q6_K", "v"), ("Q4_K", "o"), ("Q6_K", "output")]
        shapes = {**QWEN3MOE, "output": (151936, 2048)}
    geos = [(32, 1), (64, 1), (64, 2), (128, 1), (128, 2)]
    targets, stages = (528, 1056, 2112), (1,)
    if model == "pipe":
        cases = [("Q4_K", "gate_up"), ("Q4_K", "down"), ("Q4_K", "qkv"), ("Q4_K", "o")]
        cases += [("Q6_K", "down")]
        geos, targets, stages = [(64, 1), (128, 1)], (132, 264, 528, 1056, 2112), (1, 2, 3)
    print("| type | shape | N x K | block_n | warps | split | stages | us | GB/s | % of 4.25 TB/s"
          " |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, label in cases:
        qt = QuantType[name]
        n, k = shapes[label]
        raw = _blocks(qt, n, k).cuda()
        p = pack_blocks(raw, qt, n, k)
        x = torch.randn(1, k, device="cuda")
        rows = min(n, 2048)  # reference on a slice of rows (float64 of the whole head is big)
        w = dequantize(raw[:rows], qt).reshape(rows, k).double()
        ref = quantize_x8_reference(x.cpu()).cuda() @ w.T
        nb = k // (32 if name == "Q8_0" else 256)
        best = None
        cfgs = {packed_config(qt, n, k)}
        for bn, warps in geos:
            for target in targets:
                split = max(1, min(nb, triton_cdiv(target, triton_cdiv(n, bn))))
                spb = triton_cdiv(nb, split)
                cfgs |= {PackedConfig(bn, warps, spb, st) for st in stages if st == 1 or spb > 1}
        for cfg in sorted(cfgs, key=lambda c: (c.block_n, c.num_warps, c.blocks_per_program,
                                               c.stages)):  # fmt: skip
            cnt = split_counters(p, cfg)
            y = gemv_packed(x, p, cfg, cnt)[:, :rows].double()
            split = triton_cdiv(nb, cfg.blocks_per_program)
            err = ((y - ref).norm() / ref.norm()).item()
            if not err < 1e-5:
                bad = (y - ref).abs().argmax().item()
                print(f"| {name} | {label} | {n}x{k} | {cfg.block_n} | {cfg.num_warps} | {split} "
                      f"| {cfg.stages} | WRONG rel {err:.3g} "
                      f"nonfinite {int((~torch.isfinite(y)).sum())} "
                      f"worst row {bad} y {y.flatten()[bad].item():.4g} "
                      f"ref {ref.flatten()[bad].item():.4g} | | |")  # fmt: skip
                continue
            us = do_bench_cudagraph(partial(gemv_packed, x, p, cfg, cnt), rep=40) * 1e3
            gbs = (p.nbytes + 4 * (k + n)) / (us * 1e-6) / 1e9
            if best is None or us < best[0]:
                best = (us, cfg)
            mark = " (default)" if cfg == packed_config(qt, n, k) else ""
            print(f"| {name} | {label} | {n}x{k} | {cfg.block_n} | {cfg.num_warps} | {split} | "
                  f"{cfg.stages} | {us:.1f}{mark} | {gbs:.0f} | "
                  f"{100 * gbs * 1e9 / COPY_BW:.0f} |")  # fmt: skip
        dflt = packed_config(qt, n, k)
        cnt = split_counters(p, dflt)
        for m in (4, 8):
            xm = torch.randn(m, k, device="cuda")
            us = do_bench_cudagraph(partial(gemv_packed, xm, p, dflt, cnt), rep=40) * 1e3
            print(f"default {name} {label} M={m}: {us:.1f} us {p.nbytes / us / 1e3:.0f} GB/s")
        print(f"best {name} {label}: {best}")
        del raw, p
        torch.cuda.empty_cache()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def breakdown(path: str, depth: int = 512) -> None:
    from torch.profiler import ProfilerActivity, profile

    from localllm.engine.core.batch import BatchMeta
    from localllm.engine.gguf import open_gguf
    from localllm.engine.loader import build_model
    from localllm.engine.runtime.kv_cache import PagedKVCache

    gg = open_gguf(path)
    model = build_model(gg, device="cuda")
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, depth // 16 + 2, 16, kvh, hd, "f16", "cuda", model.kv_value_dim())

    def step(n: int, start: int):
        b = BatchMeta.contiguous(n, start + n, 16)
        b = BatchMeta(b.query_start, b.seq_lens, b.block_tables, b.slot_mapping.cuda(), 16)
        ids = torch.randint(0, model.args.vocab_size, (n,), device="cuda")
        pos = torch.arange(start, start + n, device="cuda")
        return model.logits(model(ids, pos, b, kv)[-1:])

    with torch.inference_mode():
        step(depth, 0)
        for _ in range(3):
            step(1, depth)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            step(1, depth)
        e1.record()
        torch.cuda.synchronize()
        step_ms = e0.elapsed_time(e1) / 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(1, depth)
            torch.cuda.synchronize()
        import cProfile
        import pstats

        cp = cProfile.Profile()
        cp.enable()
        for _ in range(5):
            step(1, depth)
        torch.cuda.synchronize()
        cp.disable()
    print("host time of 5 decode steps, top functions by own time:")
    pstats.Stats(cp).sort_stats("tottime").print_stats(14)
    weight_bytes = sum(
        k.nbytes for m in model.modules() if hasattr(m, "kernels") for k in m.kernels()
    )
    kv_bytes = 2 * layers * depth * kvh * hd * 2
    floor_ms = (weight_bytes + kv_bytes) / COPY_BW * 1e3
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t <= 0 or evt.key.startswith("ProfilerStep"):
            continue
        g = groups[_group(evt.key)]
        g[0] += t / 1e3
        g[1] += evt.count
    gpu_ms = sum(v[0] for v in groups.values())
    print(f"decode step at depth {depth}: {step_ms:.2f} ms wall ({1e3 / step_ms:.0f} t/s), "
          f"GPU busy {gpu_ms:.2f} ms; byte floor {floor_ms:.2f} ms "
          f"({(weight_bytes + kv_bytes) / 2**30:.2f} GiB weights+KV at 4.25 TB/s)")  # fmt: skip
    print("| op group | launches | GPU ms | share of step |")
    print("|---|---:|---:|---:|")
    for key, (ms, cnt) in sorted(groups.items(), key=lambda kv_: -kv_[1][0]):
        print(f"| {key} | {cnt} | {ms:.3f} | {100 * ms / step_ms:.0f}% |")
    evts = prof.key_averages()
    names = sorted((getattr(e, "device_time_total", 0) / 1e3, e.count, e.key[:70]) for e in evts)
    names.reverse()
    for ms, cnt, key in names[:25]:
        print(f"kernel | {key} | {cnt} | {ms:.3f} ms")
    print(f"| (idle: launch/host overhead) | - | {step_ms - gpu_ms:.3f} | "
          f"{100 * (step_ms - gpu_ms) / step_ms:.0f}% |")  # fmt: skip
    gg.close()


def _group(name: str) -> str:
    for key in ("_gemv_q4k_packed", "_gemv_q6k_packed", "_gemv_q8_0_packed", "_quant_x8"):
        if key in name:
            return key.strip("_")
    for key in ("_gemv_q4_k", "_gemv_q6_k", "_gemv_q8_0", "_deq_"):
        if key in name:
            return key.strip("_")
    for key, label in (("gemm", "cuBLAS GEMM/GEMV"), ("softmax", "softmax"), ("index", "gather")):
        if key in name.lower():
            return label
    return "elementwise/other" if "elementwise" in name or "vectorized" in name else name[:50]


if __name__ == "__main__":
    if sys.argv[1] == "kernels":
        kernels()
    elif sys.argv[1] == "sweep":
        sweep()
    elif sys.argv[1] == "packed":
        packed(*sys.argv[2:3])
    else:
        breakdown(sys.argv[2])
