"""Limits a test puts around loading a hostile file: a watchdog and an address-space budget.

`load_limits(seconds, budget)` interrupts the block with `LoadTimeout` (from SIGALRM) once it has
run `seconds`, and caps the process's address space at what it maps now plus `budget` bytes
(RLIMIT_AS), so an allocation sized from a hostile value fails at once (torch raises RuntimeError,
numpy MemoryError) instead of swapping the machine. Neither is a ValueError, so a test expecting a
clean refusal fails on it. Both limits are lifted on exit.
"""

import contextlib
import resource
import signal

DEFAULT_SECONDS = 10.0  # a watchdog, not a timing assertion: real refusals take milliseconds
DEFAULT_BUDGET = 1 << 30  # 1 GiB of new address space: tiny models need a few MiB


class LoadTimeout(Exception):
    """The block ran past its watchdog (a hang or minutes of work on a hostile value)."""


def mapped_bytes() -> int:
    """The process's address space now (VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def load_limits(seconds: float = DEFAULT_SECONDS, budget: int = DEFAULT_BUDGET):
    def on_alarm(signum, frame):
        raise LoadTimeout(f"still loading after {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_limit = resource.getrlimit(resource.RLIMIT_AS)
    soft = mapped_bytes() + budget
    if old_limit[1] != resource.RLIM_INFINITY:
        soft = min(soft, old_limit[1])
    resource.setrlimit(resource.RLIMIT_AS, (soft, old_limit[1]))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, old_limit)
        signal.signal(signal.SIGALRM, old_handler)
