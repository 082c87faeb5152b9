"""Where a prompt's GPU time goes: `localllm bench` arguments run under torch.profiler (CUDA
activity only, so the host side is not slowed), kernels listed by total device time. The bench
runs a warm-up and its repetitions: divide the totals by (1 + r) for one prompt. Run on the
H200: `python3 tests/perf/prof_prefill.py -m FILE --device cuda -p 512 -n 0 -r 1`."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from localllm.app.bench import main

if __name__ == "__main__":
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        main(sys.argv[1:])
    events = prof.key_averages()
    print(events.table(sort_by="device_time_total", row_limit=40, max_name_column_width=60))
    total = sum(e.device_time_total for e in events) / 1e3
    print(f"device time, all kernels: {total:.1f} ms ({torch.cuda.get_device_name()})")
