"""Decode overhead of LoRA adapters (issue 36): `localllm bench` tg with 0, 1 and 4 rank-R
adapters on every token, alternated round by round in one run (a shared machine's load moves
all cases alike), and llama.cpp's llama-server with the same GGUF LoRAs where a build is given.
Not a test.

    python tests/perf/bench_lora.py make --model BASE.gguf --out DIR [--rank 16 --count 4]
    python tests/perf/bench_lora.py ab --model BASE.gguf --dir DIR [--rounds 3 -n 32 -t 2]
        [--cases "base;1 adapter;1 adapter, fused kernel"]
    python tests/perf/bench_lora.py delta --model BASE.gguf --dir DIR [--rounds 6 -n 32]
    python tests/perf/bench_lora.py llamacpp --server llama-server --model BASE.gguf --dir DIR

`ab` is what a user sees (a base without adapters takes the native CPU decode step, which a
model with adapters hung on leaves for the torch layers; on CUDA it adds the adapters through
the torch ops; `--cases` picks cases, among them the one-launch kernel (`engine.lora.delta`'s
SCHEME "fused"), the expand in the base GEMVs' epilogue (SCHEME "epilogue", cases "N
adapter(s), epilogue"; the default since 2026-12-06, so the plain "N adapter(s)" cases run it
too), the two-launch kernels ("N adapter(s), atomic") and the shrink in the GEMVs too
("inline"): the A/B of the kernel schemes, each case its own process, alternated round by
round); `delta` is the deltas alone:
one process, one model with 1 (then 4) adapters hung on, decode steps alternating between no
row on an adapter (the deltas skipped) and every row on all of them.

`make` writes DIR/lora-K.gguf in llama.cpp's adapter format (`general.type = adapter`,
`adapter.type = lora`, alpha = rank: scale 1) on every attention and MLP linear of the base,
random A and B (std 0.02 / 0.02: a visible but sane delta), float32 (`--dtype f16`: as
convert_lora_to_gguf.py writes by default); both engines read them.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# case -> (adapters loaded, their scale): "4 at scale 0" are hung on but no row uses them
CASES = {"base": (0, 1.0), "1 adapter": (1, 1.0), "4 adapters": (4, 1.0), "4 at scale 0": (4, 0.0)}
# `ab` on CUDA only: the same adapters through the torch ops instead of the kernels (the A/B of
# engine/lora/delta.py's KERNELS switch), the first kernels and the one-launch kernel (SCHEME)
GPU_CASES = {
    "1 adapter, torch ops": (1, 1.0),
    "1 adapter, fused kernel": (1, 1.0),
    "4 adapters, fused kernel": (4, 1.0),
    "1 adapter, epilogue": (1, 1.0),
    "4 adapters, epilogue": (4, 1.0),
    "1 adapter, epilogue launched": (1, 1.0),
    "4 adapters, epilogue launched": (4, 1.0),
    "4 adapters, producers": (4, 1.0),
    "1 adapter, producers split": (1, 1.0),
    "4 adapters, producers split": (4, 1.0),
    "1 adapter, silu narrow": (1, 1.0),
    "1 adapter, silu narrow split": (1, 1.0),
    "4 adapters, producers narrow split": (4, 1.0),
    "1 adapter, inline": (1, 1.0),
    "4 adapters, inline": (4, 1.0),
    "1 adapter, atomic": (1, 1.0),
    "4 adapters, atomic": (4, 1.0),
    "1 adapter, partials": (1, 1.0),
    "4 adapters, producers partials": (4, 1.0),
    "1 adapter, early": (1, 1.0),
    "4 adapters, producers early": (4, 1.0),
    "1 adapter, apf": (1, 1.0),
    "4 adapters, apf": (4, 1.0),
}
# `localllm bench` with module switches set, in its own process (tests/perf/with_switches.py)
D = "localllm.engine.lora.delta."


def _switches(case: str) -> list[str]:
    # "apf": the SiLU and combine programs' first rows of A loaded before their PDL wait
    apf = ["localllm.kernels.fused.triton_ops.SILU_LORA_PREFETCH=True",
           "localllm.kernels.attention.triton_decode.COMBINE_LORA_PREFETCH=True"]  # fmt: skip
    apf = apf if "apf" in case else []
    return _scheme_switches(case) + apf


def _scheme_switches(case: str) -> list[str]:
    if "torch ops" in case:
        return [D + "KERNELS=False"]
    if "fused kernel" in case:
        return [D + "SCHEME='fused'"]
    if "partials" in case or "early" in case:  # the input kernels store partial shrinks, the
        # epilogues sum them ("early": split 0's programs, `triton_lora_tail.EARLY_TAIL`)
        sets = [D + "SCHEME='epilogue'", D + "PARTIAL_SHRINK=True"]
        sets += (
            ["localllm.kernels.quant.triton_lora_tail.EARLY_TAIL=True"] if "early" in case else []
        )
        lift = [D + "PRODUCER_MAX_RANK=1048576", D + "PARTIAL_MAX_RANK=1048576"]
        return sets + (lift if "producers" in case else [])
    if "producers" in case or "silu narrow" in case:  # every shrink in the input kernels,
        # whatever its rank ("producers"; one adapter's take them by default); "split": the
        # SiLU's and the attention combine's over more programs (8 rows of A each); "narrow":
        # the SiLU's programs 256 columns wide
        sets = [D + "SCHEME='epilogue'"]
        sets += [D + "PRODUCER_MAX_RANK=1048576"] if "producers" in case else []
        sets += [D + "PARTIAL_SHRINK=False"]  # (these cases time the atomics)
        if "split" in case:
            sets += ["localllm.kernels.fused.triton_ops.SILU_LORA_RSTEP=8",
                     "localllm.kernels.attention.triton_decode.COMBINE_LORA_RSTEP=8"]  # fmt: skip
        if "narrow" in case:
            sets += ["localllm.kernels.fused.triton_ops.SILU_LORA_BH=256"]
        return sets
    if "epilogue launched" in case:  # every shrink launched (none run by the norm / SiLU kernels)
        return [D + "SCHEME='epilogue'", D + "PRODUCER_SHRINK=False"]
    if "epilogue" in case:  # the expand in the base GEMVs' epilogue
        return [D + "SCHEME='epilogue'"]
    if "inline" in case:  # the shrink and the expand in the base GEMVs
        return [D + "SCHEME='inline'"]
    if "atomic" in case:  # the two-launch kernels (the default until 2026-12-06 20:47 UTC)
        return [D + "SCHEME='atomic'"]
    return []


def _launcher(case: str) -> list[str]:
    switches = _switches(case)
    if not switches:
        return ["-m", "localllm.app"]
    return [str(Path(__file__).parent / "with_switches.py"), *switches, "--", "-m", "localllm.app"]


def make(a) -> None:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(a.model)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    shapes = {t.name.removesuffix(".weight"): tuple(int(d) for d in t.shape[::-1])
              for t in reader.tensors if t.name.endswith(".weight")}  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for k in range(a.count):
        rng = np.random.default_rng(1000 + k)
        w = gguf.GGUFWriter(out / f"lora-{k}.gguf", arch)
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(a.rank))
        for name, shape in shapes.items():
            if name.rpartition(".")[2] not in TARGETS or len(shape) != 2:
                continue
            rows, cols = shape
            dt = np.float16 if getattr(a, "dtype", "f32") == "f16" else np.float32
            a_ = (0.02 * rng.standard_normal((a.rank, cols))).astype(dt)
            b_ = (0.02 * rng.standard_normal((rows, a.rank))).astype(dt)
            w.add_tensor(f"{name}.weight.lora_a", a_)
            w.add_tensor(f"{name}.weight.lora_b", b_)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        print(out / f"lora-{k}.gguf")


def _adapters(a, n: int) -> list[str]:
    return [str(Path(a.dir) / f"lora-{k}.gguf") for k in range(n)]


def ab(a) -> None:
    known = {**CASES, **(GPU_CASES if a.device != "cpu" else {})}
    cases = {c: known[c] for c in list(known)[: len(CASES) + 1]}  # (+ torch ops on CUDA)
    if a.cases:
        picked = [c.strip() for c in a.cases.split(";")]
        bad = [c for c in picked if c not in known]
        if bad:
            raise SystemExit(f"unknown --cases {bad}; known: {list(known)}")
        cases = {c: known[c] for c in picked}
    rows: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(a.rounds):
        for case, (n, scale) in cases.items():
            cmd = [
                sys.executable,
                *_launcher(case),
                "bench",
                "-m",
                a.model,
                "-p",
                "0",
                "-n",
                str(a.n_gen),
                "-r",
                str(a.reps),
                "-o",
                "json",
                "--device",
                a.device,
            ]
            cmd += ["-t", str(a.threads)] if a.threads else []
            for p in _adapters(a, n):
                cmd += ["--lora", f"{p}:{scale}"]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            ts = json.loads(out)[0]["samples_ts"]
            rows[case] += ts
            print(f"round {r + 1} {case}: {statistics.fmean(ts):.2f} t/s", file=sys.stderr)
    base = statistics.median(rows["base"]) if "base" in rows else None
    n_runs = len(next(iter(rows.values())))
    print(f"| case | tg{a.n_gen} t/s (median of {n_runs}) | range | overhead |")
    print("| --- | ---: | ---: | ---: |")
    for case, ts in rows.items():
        med = statistics.median(ts)
        over = f"{100 * (base / med - 1):+.1f} %" if base else "-"  # extra time per token
        print(f"| {case} | {med:.2f} | {min(ts):.2f}-{max(ts):.2f} | {over} |")


def delta(a) -> None:
    import torch

    from localllm.engine.core.batch import BatchMeta
    from localllm.engine.loader import build_model, open_weights
    from localllm.engine.lora import LoraSpec, attach_adapters
    from localllm.engine.runtime.kv_cache import PagedKVCache

    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    print(f"| adapters | tg{a.n_gen} t/s, deltas off | deltas on | overhead |")
    print("| ---: | ---: | ---: | ---: |")
    for n in (1, 4):
        weights = open_weights(a.model)
        model = build_model(weights, device=device)
        specs = [LoraSpec(p) for p in _adapters(a, n)]
        loras = attach_adapters(model, specs, weights, device)
        layers, kvh, hd = model.kv_shape()
        kv = PagedKVCache(layers, -(-(a.n_gen + 40) // 16), 16, kvh, hd, "f16", device)

        def step(pos: int, model=model, kv=kv):
            b = BatchMeta.contiguous(1, pos + 1, 16)
            b = BatchMeta(b.query_start, b.seq_lens, b.block_tables,
                          b.slot_mapping.to(device), 16)  # fmt: skip
            ids = torch.tensor([5], device=device)
            return model.logits(model(ids, torch.tensor([pos], device=device), b, kv))

        rates: dict[bool, list[float]] = {False: [], True: []}
        with torch.inference_mode():
            for p in range(8):
                step(p)
            for _ in range(a.rounds):
                for on in (False, True):
                    model.lora.set_rows([(loras.resolve(None) if on else (), 1)])
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for p in range(8, 8 + a.n_gen):
                        step(p)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    rates[on].append(a.n_gen / (time.perf_counter() - t0))
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"| {n} | {off:.2f} | {on:.2f} | {100 * (off / on - 1):+.1f} % |")
        weights.close()


def llamacpp(a) -> None:
    """llama-server with the same adapters (scale 1 each): its own predicted_per_second."""
    for case, (n, scale) in CASES.items():
        cmd = [
            a.server,
            "-m",
            a.model,
            "--port",
            str(a.port),
            "-ngl",
            "99",
            "-c",
            "2048",
            "-np",
            "1",
        ]
        for p in _adapters(a, n):
            cmd += ["--lora-scaled", f"{p}:{scale}"]
        log = Path(a.log_dir) / f"llama-server-{case.replace(' ', '-')}.log" if a.log_dir else None
        sink = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{a.port}"
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.5)
            speeds = []
            for _ in range(a.reps + 1):  # the first is a warm-up
                body = {
                    "prompt": "The capital of France is",
                    "n_predict": a.n_gen,
                    "temperature": 0,
                    "ignore_eos": True,
                    "cache_prompt": False,
                }
                if n:  # llama-server's per-request adapters, as `--lora-scaled` set them
                    body["lora"] = [{"id": i, "scale": scale} for i in range(n)]
                req = urllib.request.Request(
                    f"{url}/completion",
                    json.dumps(body).encode(),
                    {"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=300) as r:
                        speeds.append(json.loads(r.read())["timings"]["predicted_per_second"])
                except urllib.error.HTTPError as e:  # the server's own words, then the next case
                    print(f"| llama-server {case} | HTTP {e.code}: {e.read()[:300]!r} | |")
                    break
            else:
                print(
                    f"| llama-server {case} | {statistics.median(speeds[1:]):.2f} | "
                    f"{min(speeds[1:]):.2f}-{max(speeds[1:]):.2f} |"
                )
        finally:
            proc.terminate()
            proc.wait(30)
            if log:
                sink.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--model", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--rank", type=int, default=16)
    m.add_argument("--count", type=int, default=4)
    # f16: what llama.cpp's convert_lora_to_gguf.py writes by default (--outtype f16)
    m.add_argument("--dtype", choices=("f32", "f16"), default="f32")
    for name in ("ab", "delta", "llamacpp"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True)
        s.add_argument("--dir", required=True)
        s.add_argument("-n", "--n-gen", type=int, default=32)
        s.add_argument("--reps", type=int, default=3)
        s.add_argument("--rounds", type=int, default=3)
        s.add_argument("-t", "--threads", type=int, default=None)
        s.add_argument("--device", default="cpu")
        s.add_argument("--server", default=".llb/bin/llama-server")
        s.add_argument("--port", type=int, default=8391)
        s.add_argument("--log-dir", default=None, help="llama-server's output per case (llamacpp)")
        s.add_argument("--cases", default=None, help="ab: the cases to run, ';'-separated")
    a = ap.parse_args()
    {"make": make, "ab": ab, "delta": delta, "llamacpp": llamacpp}[a.cmd](a)


if __name__ == "__main__":
    main()
