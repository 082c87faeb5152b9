"""Where a prompt's time goes: `localllm bench` arguments run under torch.profiler (on a GPU
the CUDA activity only, so the host side is not slowed; on a CPU the CPU ops), listed by total
time. The bench runs a warm-up and its repetitions: divide the totals by (1 + r) for one
prompt. On the H200: `python3 tests/perf/prof_prefill.py -m FILE --device cuda -p 512 -n 0 -r 1`.

`--trace FILE.json.gz` records the host side too and writes the trace; `--gaps FILE.json.gz`
(no bench run) reads one back and says how busy the device was: its busy time against the span,
the idle gaps summed by the pair of kernels around them (a host sync or slow host code shows up
as a large gap after one kernel), and the host's CUDA runtime calls by count and time.
"""

import argparse
import gzip
import json
import os
import sys
from collections import Counter, defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:70]


def gaps(path: str, top: int = 25) -> None:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    dev = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), _short(e["name"]))
        for e in events
        if e.get("cat") in DEVICE_CATS
    )
    if not dev:
        print("no device activity in the trace")
        return
    span = dev[-1][1] - dev[0][0]
    busy, end, pair_gap, pair_n = 0.0, dev[0][0], defaultdict(float), Counter()
    prev = "(start)"
    for start, stop, name in dev:
        if start > end:
            pair_gap[(prev, name)] += start - end
            pair_n[(prev, name)] += 1
        busy += max(0.0, stop - max(start, end))
        end, prev = max(end, stop), name
    print(f"device: {len(dev)} activities, busy {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms span")
    print(f"idle gaps by the kernels around them (top {top}), ms total / count:")
    for (a, b), t in sorted(pair_gap.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t / 1e3:8.2f} {pair_n[(a, b)]:6d}  {a}  ->  {b}")
    kern, kern_n = defaultdict(float), Counter()
    for start, stop, name in dev:
        kern[name] += stop - start
        kern_n[name] += 1
    print("device time by kernel, ms / count:")
    for name, t in sorted(kern.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t / 1e3:8.2f} {kern_n[name]:6d}  {name}")
    rt, rt_n = defaultdict(float), Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            rt[e["name"]] += e.get("dur", 0)
            rt_n[e["name"]] += 1
    print("host CUDA runtime calls, ms / count:")
    for name, t in sorted(rt.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {t / 1e3:8.2f} {rt_n[name]:6d}  {name}")


def profile_bench(argv: list[str], trace: str | None) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from localllm.app.bench import main

    gpu = torch.cuda.is_available()
    acts = [ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]
    if trace and gpu:
        acts.append(ProfilerActivity.CPU)
    with profile(activities=acts) as prof:
        main(argv)
    events = prof.key_averages()
    key = "device_time_total" if gpu else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=40, max_name_column_width=60))
    total = sum(getattr(e, key) for e in events) / 1e3
    where = torch.cuda.get_device_name() if gpu else "CPU, self time"
    print(f"all ops: {total:.1f} ms ({where})")
    if trace:
        raw = trace.removesuffix(".gz")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            dst.write(src.read())
        os.remove(raw)
        gaps(trace)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--trace")
    ap.add_argument("--gaps")
    ours, rest = ap.parse_known_args(sys.argv[1:])
    if ours.gaps:
        gaps(ours.gaps)
    else:
        profile_bench(rest, ours.trace)
