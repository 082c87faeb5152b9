"""Download progress: a tqdm-compatible class for huggingface_hub that reports to a callback,
the same reports for the sha256 check that follows each download, and a one-line terminal
renderer (bytes, speed, ETA)."""

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO


@dataclass(frozen=True)
class Progress:
    """One progress report for one file."""

    filename: str
    done: int
    total: int | None
    speed: float  # bytes per second since this file started
    eta: float | None  # seconds left, None when unknown
    phase: str = "download"  # or "verify": hashing the file against the Hub's sha256

    @property
    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total


ProgressCallback = Callable[[Progress], None]


def progress_class(filename: str, callback: ProgressCallback) -> type:
    """A class huggingface_hub can use as `tqdm_class`, bound to one file and one callback.

    huggingface_hub calls `cls(desc=..., total=..., initial=..., unit=..., unit_scale=...)`,
    enters it as a context manager and calls `update(n)` per chunk (negative on a restart).
    """

    class _Bar:
        def __init__(self, *args: Any, total: int | None = None, initial: int = 0, **_: Any):
            self.total, self.n, self._start, self._first = total, initial, time.monotonic(), initial
            callback(Progress(filename, self.n, total, 0.0, None))

        def update(self, n: int = 1) -> None:
            self.n += n
            elapsed = max(time.monotonic() - self._start, 1e-6)
            speed = max(self.n - self._first, 0) / elapsed
            eta = (self.total - self.n) / speed if self.total and speed > 0 else None
            callback(Progress(filename, self.n, self.total, speed, eta))

        def close(self) -> None:
            pass

        def __enter__(self) -> "_Bar":
            return self

        def __exit__(self, *exc: Any) -> None:
            self.close()

    return _Bar


def hash_reporter(filename: str, callback: ProgressCallback) -> Callable[[int, int], None]:
    """A `(hashed, size)` callback for the verification of one file, reporting as `Progress`."""
    start = time.monotonic()

    def report(done: int, total: int) -> None:
        speed = done / max(time.monotonic() - start, 1e-6)
        eta = (total - done) / speed if speed > 0 else None
        callback(Progress(filename, done, total, speed, eta, phase="verify"))

    return report


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60:02d}:{s % 60:02d}"


def render(p: Progress) -> str:
    """`file  12.3 MB / 45.6 MB  27%  5.1 MB/s  ETA 00:07` (`file  verifying  12.3 MB ...`)."""
    total = f" / {human_bytes(p.total)}" if p.total else ""
    pct = f"  {100 * p.done // p.total:3d}%" if p.total else ""
    phase = "  verifying" if p.phase == "verify" else ""
    return (
        f"{p.filename}{phase}  {human_bytes(p.done)}{total}{pct}  "
        f"{human_bytes(p.speed)}/s  ETA {_clock(p.eta)}"
    )


def terminal_printer(stream: TextIO = sys.stderr, min_interval: float = 0.2) -> ProgressCallback:
    """A callback that redraws one line per file on a terminal (plain lines elsewhere)."""
    last = [0.0]  # closure state: when we last drew, to limit redraws

    def show(p: Progress) -> None:
        now = time.monotonic()
        if not p.finished and now - last[0] < min_interval:
            return
        last[0] = now
        if stream.isatty():
            stream.write("\r\x1b[K" + render(p) + ("\n" if p.finished else ""))
        elif p.finished:
            stream.write(render(p) + "\n")
        stream.flush()

    return show
