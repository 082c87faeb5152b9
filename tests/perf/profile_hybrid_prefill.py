"""Where a hybrid model's prompt time goes on CUDA: one 512-token prefill of a GGUF (loaded as
`localllm bench` loads it: everything on the GPU, one sequence's state slot), eager as bench
runs hybrid prompts. Prints, compactly:

- wall ms per prefill, and the host's share: how long the forward takes to return (launches
  queued) before the GPU is waited for, for the token-by-token Mamba-2 scan
  (`triton_step.ssd_varlen_triton`, shipped) and the chunked one (`triton_ssd_chunked`, opt-in
  since 2026-12-06: CHUNKED_MIN_ROWS set to 64 here) with IEEE float32 dots and with
  `--chunk-precision` (env SSD_DOT_PRECISION, default "tf32x3": the kernel's DOT_PRECISION set
  for that mode only, its default left alone), and both scans replayed as a prompt CUDA graph
  (`prefill_graphs.STATEFUL`, off by default: one `PrefillGraphs` per mode, captured at the
  warm-up), alternated in one process;
- host syncs inside one forward (`torch.cuda.set_sync_debug_mode`), by source line;
- a torch.profiler table of one forward: kernels by CUDA time with call counts, and the
  mixers / MoE FFNs / attention as ranges;
- the scan alone at the model's shape (both kernels, each dot precision), per layer call.

    python tests/perf/profile_hybrid_prefill.py -m /tmp/g4t.gguf [-p 512] [--reps 5]
        [--chunk-precision tf32x3] [--no-profile]

`--no-profile`: the timings and the scan alone only (no sync count, no profiler table).
"""

import argparse
import collections
import os
import time
import warnings

import torch


def _load(path: str, n: int, dev: torch.device):
    from localllm.engine.loader import build_model, open_weights
    from localllm.engine.runtime.kv_cache import PagedKVCache
    from localllm.engine.runtime.recurrent_state import attach_states

    gguf = open_weights(path)
    model = build_model(gguf, device=dev)
    layers, kvh, hd = model.kv_shape()
    blocks = -(-n // 16)
    kv = PagedKVCache(layers, blocks + 1, 16, kvh, hd, "f16", dev, model.kv_value_dim())
    attach_states(kv, model, 1)
    return model, kv


_GRAPH: dict = {}  # the graph modes' PrefillGraphs, by mode name (None: this one runs eager)


def _forward(model, kv, ids):
    from localllm.engine.core.batch import BatchMeta

    n = ids.shape[0]
    prompts = _GRAPH.get(_KEEP.get("mode"))
    if prompts is not None:  # a prompt graph's replay (its first call captures it)
        slots = torch.arange(n, device=ids.device)
        h = prompts.run(ids, slots, 0, list(range(-(-n // kv.block_size))), 0)
        if h is None:
            raise RuntimeError(f"prompt graph not replayed: {prompts.failed}")
        return model.logits(h[-1:])
    b = BatchMeta.contiguous(n, n, kv.block_size)
    b = BatchMeta(b.query_start, b.seq_lens, b.block_tables, b.slot_mapping.to(ids.device),
                  b.block_size)  # fmt: skip
    h = model(ids, torch.arange(n, device=ids.device), b, kv)
    return model.logits(h[-1:])


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(model, kv, ids) -> tuple[float, float]:
    """(ms until the forward returned, ms until the GPU finished)."""
    _sync(ids.device)
    t0 = time.perf_counter()
    _forward(model, kv, ids)
    t1 = time.perf_counter()
    _sync(ids.device)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3


def _syncs(model, kv, ids) -> collections.Counter:
    if not ids.is_cuda:
        return collections.Counter()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _forward(model, kv, ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return collections.Counter(
        f"{w.filename.split('/localllm/')[-1]}:{w.lineno}"
        for w in got
        if "synchroniz" in str(w.message)
    )


def _ranges(model) -> list:
    """record_function ranges around the mixers, MoE FFNs and attention (profiler rows)."""
    from localllm.engine.moe.block import MoEFeedForward

    handles = []
    for m in model.modules():
        kind = type(m).__name__
        if kind not in ("Mamba2", "ShortConv", "GatedDeltaNet") and not isinstance(
            m, MoEFeedForward
        ):
            continue
        label = f"range:{'moe' if isinstance(m, MoEFeedForward) else kind.lower()}"

        def pre(mod, args, label=label):
            mod._rf = torch.profiler.record_function(label)
            mod._rf.__enter__()

        def post(mod, args, out):
            mod._rf.__exit__(None, None, None)

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return handles


def _profile(model, kv, ids, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    handles = _ranges(model)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
    try:
        _sync(ids.device)
        with profile(activities=acts) as prof:
            _forward(model, kv, ids)
            _sync(ids.device)
    finally:
        for h in handles:
            h.remove()
    ev = prof.key_averages()
    # kernels (and copies): the events with device time of their own; ops and ranges have none
    kernels = [e for e in ev if _self_dev(e) > 0 and not e.key.startswith("range:")]
    total = sum(_self_dev(e) for e in kernels)
    print(f"\n### profiler: one forward, GPU kernels {total / 1e3:.2f} ms in "
          f"{sum(e.count for e in kernels)} launches")  # fmt: skip
    print("| kernel | calls | CUDA ms | share |\n|---|---:|---:|---:|")
    kernels.sort(key=_self_dev, reverse=True)
    for e in kernels[:top]:
        t = _self_dev(e)
        print(f"| {e.key[:70]} | {e.count} | {t / 1e3:.3f} | {100 * t / max(total, 1):.1f}% |")
    print("\n| range | calls | CPU ms (host) | CUDA ms (inside) |\n|---|---:|---:|---:|")
    for e in ev:
        if e.key.startswith("range:"):
            print(f"| {e.key[6:]} | {e.count} | {e.cpu_time_total / 1e3:.2f} | "
                  f"{getattr(e, 'device_time_total', 0) / 1e3:.2f} |")  # fmt: skip
    ops = sorted((e for e in ev if e.key.startswith("aten::")), key=lambda e: -e.count)
    print("\naten ops by calls (host dispatches):",
          ", ".join(f"{e.key[6:]} {e.count}" for e in ops[:15]))  # fmt: skip


def _self_dev(e) -> float:
    return getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)


def _scan_alone(model, kv, ids, top: int) -> None:
    """Both prompt scans at one Mamba-2 layer's shape, per call (CUDA events, 20 calls)."""
    a, n = model.args, ids.shape[0]
    if not getattr(a, "n_ssm_heads", 0) or not ids.is_cuda:
        return
    import localllm.kernels.recurrent.triton_ssd_chunked as ch
    from localllm.kernels.recurrent.triton_step import ssd_varlen_triton

    h, p, g, s = a.n_ssm_heads, a.head_size, a.n_groups, a.d_state
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, h, p, device=dev, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(n, h, device=dev, generator=gen) - 2)
    A = -torch.rand(h, device=dev, generator=gen) - 0.1
    B, C = (torch.randn(n, g, s, device=dev, generator=gen) for _ in range(2))
    st0 = torch.randn(1, h, p, s, device=dev, generator=gen) * 0.1
    qs = torch.tensor([0, n], dtype=torch.int32, device=dev)
    ref_state = st0.clone()
    ref = ssd_varlen_triton(x, dt, A, B, C, ref_state, qs)

    def one(fn) -> float:
        for _ in range(3):
            fn()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / 20 * 1e3

    print(f"\n### the scan alone: {n} tokens, {h} heads of {p}, {g} group(s), state {s} "
          "(us per layer call; max |diff| vs token by token)")  # fmt: skip
    us = one(lambda: ssd_varlen_triton(x, dt, A, B, C, st0.clone(), qs))
    print(f"token by token (triton_step.ssd_varlen_triton): {us:.1f} us")
    keep = (ch.DOT_PRECISION, ch.BLOCK_P, ch.WARPS)
    defaults = (keep[0], ch.CHUNK, keep[1], keep[2])
    configs = [defaults] + [
        c
        for c in [("tf32", 64, 32, 4), ("tf32x3", 64, 32, 4), ("tf32x3", 64, 32, 8),
                  ("tf32x3", 128, 32, 8), ("ieee", 64, 32, 8), ("ieee", 64, 64, 8),
                  ("ieee", 32, 32, 4), ("ieee", 32, 16, 4), ("ieee", 128, 32, 8)]
        if c != defaults
    ]  # fmt: skip
    for prec, chunk, bp, warps in configs:
        ch.DOT_PRECISION, ch.BLOCK_P, ch.WARPS = prec, bp, warps
        rows, first = ch.chunk_table([0, n], chunk)
        chunks = torch.tensor(rows, dtype=torch.int32, device=dev).view(-1, 2)
        firsts = torch.tensor(first, dtype=torch.int32, device=dev)
        name = f"chunked {prec}, L {chunk}, BP {bp}, {warps} warps"
        name += " (kernel defaults)" if (prec, chunk, bp, warps) == defaults else ""
        try:
            stc = st0.clone()
            y = ch.ssd_chunked_triton(x, dt, A, B, C, stc, chunks, firsts, chunk)
            diff = (y - ref).abs().max().item() / ref.abs().max().item()
            sdiff = (stc - ref_state).abs().max().item() / ref_state.abs().max().item()
            plan = (chunks, firsts, chunk)
            us = one(lambda plan=plan: ch.ssd_chunked_triton(x, dt, A, B, C, st0.clone(), *plan))
            print(f"{name}: {us:.1f} us (rel diff y {diff:.2e}, state {sdiff:.2e})")
        except Exception as e:  # a config this triton or GPU refuses: say so, go on
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}")
        finally:
            ch.DOT_PRECISION, ch.BLOCK_P, ch.WARPS = keep


# (Mamba-2 prompt scan, its dot precision, the mixer's end): the shipped path first (the one
# profiled), then the chunked scan (opt-in) at IEEE float32 and at --chunk-precision, then the
# path before the fused end
MODES = {
    "token-by-token scan, fused end": ("tokens", None, True, False),
    "chunked scan ieee, fused end": ("chunked", "ieee", True, False),
    "chunked scan {prec}, fused end": ("chunked", "{prec}", True, False),
    "token-by-token scan, torch end": ("tokens", None, False, False),
    "prompt graph, token-by-token scan": ("tokens", None, True, True),
    "prompt graph, chunked scan {prec}": ("chunked", "{prec}", True, True),
}
CHUNKED_ROWS = 64  # CHUNKED_MIN_ROWS for the chunked modes (the default until f0183c3)
_KEEP: dict = {}


def _modes(prec: str) -> dict:
    """MODES with the asked chunk precision filled in (no duplicate when it is "ieee")."""
    out = {}
    for k, (scan, p, fused, graph) in MODES.items():
        out[k.format(prec=prec)] = (scan, p.format(prec=prec) if p else None, fused, graph)
    return out


def _graphs(modes: dict, model, kv) -> None:
    """A `PrefillGraphs` (hybrid prompts on) for each graph mode, over the one sequence's blocks
    and the spare block after them."""
    import localllm.engine.runtime.prefill_graphs as pg

    keep, pg.STATEFUL = pg.STATEFUL, True
    try:
        blocks = kv.num_blocks - 1
        for k, spec in modes.items():
            if spec[3] and kv.device.type == "cuda":
                g = pg.PrefillGraphs(model, kv, blocks * kv.block_size, blocks)
                if not g.usable:
                    raise RuntimeError(f"{k}: prompt graphs not usable for this model")
                _GRAPH[k] = g
    finally:
        pg.STATEFUL = keep


def _mode(spec: tuple, name: str | None = None) -> None:
    import localllm.engine.layers.recurrent as layers
    import localllm.kernels.recurrent.gated_norm as gated_norm
    import localllm.kernels.recurrent.triton_ssd_chunked as ch

    _KEEP.setdefault("rows", layers.CHUNKED_MIN_ROWS)
    _KEEP.setdefault("fused", gated_norm.use_triton)
    _KEEP.setdefault("prec", ch.DOT_PRECISION)
    _KEEP["mode"] = name
    scan, prec, fused, _ = spec
    layers.CHUNKED_MIN_ROWS = CHUNKED_ROWS if scan == "chunked" else 1 << 30
    ch.DOT_PRECISION = prec or _KEEP["prec"]
    gated_norm.use_triton = _KEEP["fused"] if fused else (lambda y: False)


def _restore() -> None:
    """The module defaults back (the profile and the scan alone run as shipped)."""
    import localllm.engine.layers.recurrent as layers
    import localllm.kernels.recurrent.gated_norm as gated_norm
    import localllm.kernels.recurrent.triton_ssd_chunked as ch

    if _KEEP:
        _KEEP["mode"] = None
        layers.CHUNKED_MIN_ROWS = _KEEP["rows"]
        gated_norm.use_triton = _KEEP["fused"]
        ch.DOT_PRECISION = _KEEP["prec"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    ap.add_argument(
        "--chunk-precision",
        default=os.environ.get("SSD_DOT_PRECISION", "tf32x3"),
        choices=("ieee", "tf32", "tf32x3"),
        help="tl.dot precision of the third mode's chunked scan (env SSD_DOT_PRECISION)",
    )
    ap.add_argument("--no-profile", action="store_true", help="no sync count, no profiler")
    args = ap.parse_args()
    n, dev = args.prompt, torch.device(args.device)
    modes = _modes(args.chunk_precision)
    if dev.type != "cuda":  # (prompt graphs are CUDA's)
        modes = {k: v for k, v in modes.items() if not v[3]}
    with torch.inference_mode():
        model, kv = _load(args.model, n, dev)
        _graphs(modes, model, kv)
        ids = torch.randint(0, model.args.vocab_size, (n,), device=dev)
        for k, spec in modes.items():  # warm-up: compilation, allocator, graph captures
            _mode(spec, k)
            _forward(model, kv, ids)
        got = {k: [] for k in modes}
        for _ in range(args.reps):
            for k, spec in modes.items():
                _mode(spec, k)
                got[k].append(_timed(model, kv, ids))
        _restore()
        print(f"### {args.model}: pp{n}, eager forward, median of {args.reps} (alternated)")
        print("| path | host returns ms | wall ms | t/s |\n|---|---:|---:|---:|")
        for k, v in got.items():
            host = sorted(h for h, _ in v)[len(v) // 2]
            wall = sorted(w for _, w in v)[len(v) // 2]
            print(f"| {k} | {host:.2f} | {wall:.2f} | {n / wall * 1e3:,.0f} |")
        steps = (_scan_alone,) if args.no_profile else (_syncs_line, _profile, _scan_alone)
        for step in steps:
            try:  # one section failing leaves the others' figures
                step(model, kv, ids, args.top)
            except Exception as e:
                print(f"\n{step.__name__}: failed: {type(e).__name__}: {str(e)[:300]}")


def _syncs_line(model, kv, ids, top: int) -> None:
    syncs = _syncs(model, kv, ids)
    print(f"\nhost syncs in one forward: {sum(syncs.values())}",
          "; ".join(f"{k} x{c}" for k, c in syncs.most_common(top)))  # fmt: skip


if __name__ == "__main__":
    main()
