"""Where a prompt's time goes: `localllm bench` arguments run under torch.profiler (on a GPU
the CUDA activity only, so the host side is not slowed; on a CPU the CPU ops), listed by total
time. The bench runs a warm-up and its repetitions: divide the totals by (1 + r) for one
prompt. On the H200: `python3 tests/perf/prof_prefill.py -m FILE --device cuda -p 512 -n 0 -r 1`.
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from localllm.app.bench import main

if __name__ == "__main__":
    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        main(sys.argv[1:])
    events = prof.key_averages()
    key = "device_time_total" if gpu else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=40, max_name_column_width=60))
    total = sum(getattr(e, key) for e in events) / 1e3
    where = torch.cuda.get_device_name() if gpu else "CPU, self time"
    print(f"all ops: {total:.1f} ms ({where})")
