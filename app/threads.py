"""CPU threads for torch: `-t/--threads` on every command that computes, else the cores free now.

torch's default is one thread per physical core, and its OpenMP workers spin between parallel
regions: on a box whose cores are busy with other jobs, every decode step waits for workers that
are not running (issue 39 measured 0.3 tok/s with the default against 8.2 with one thread). So
without `-t` the count is torch's default less the other tasks runnable at start (the running
count of /proc/loadavg, ourselves excluded; the median of three looks), at least one. Where
/proc/loadavg is missing (macOS, Windows) torch's default stands.
"""

import argparse
import os
import statistics
import time
from pathlib import Path

LOADAVG = Path("/proc/loadavg")


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: the cores not busy with other tasks at start)",
    )


def others_running(text: str) -> int | None:
    """Runnable tasks other than this one, from /proc/loadavg's text ("0.5 0.4 0.3 3/190 42")."""
    try:
        running = int(text.split()[3].split("/")[0])
    except (IndexError, ValueError):
        return None
    return max(0, running - 1)


def free_threads(default: int, looks: int = 3) -> int:
    """`default` less the tasks running beside us now, at least 1 (`default` when unknown)."""
    seen = []
    for i in range(looks):
        try:
            n = others_running(LOADAVG.read_text())
        except OSError:
            return default
        if n is None:
            return default
        seen.append(n)
        if i + 1 < looks:
            time.sleep(0.005)
    return max(1, min(default, os.cpu_count() or default) - int(statistics.median(seen)))


def apply_threads(args: argparse.Namespace) -> int:
    """Set torch's thread count from `args.threads` or the free cores; the count set."""
    import torch

    given = getattr(args, "threads", None)
    if given is not None and given < 1:
        raise ValueError("--threads must be at least 1")
    n = given or free_threads(torch.get_num_threads())
    torch.set_num_threads(n)
    return n
