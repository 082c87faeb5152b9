"""Shared libraries compiled from C sources at first use with the system compiler, cached on
disk under a name hashed from the sources, the compiler, the flags and the CPU (so another
process only loads them, and a `-march=native` build made on another CPU is never loaded)."""

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def compiler() -> str | None:
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def cpu_id() -> str:
    """What -march=native compiles for: a library built on another CPU must not be loaded here."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "Features", "model name"))]
    return "\n".join(sorted(set(lines)))


def build_library(
    cc: str, flags: tuple[str, ...], sources: tuple[Path, ...], stem: str, out_dir: Path
) -> Path | None:
    """`sources[0]` (the others: headers it includes, part of the key) compiled with `flags`
    into `out_dir`; None when the compiler fails."""
    ident = " ".join((cc, *flags, platform.machine(), cpu_id()))
    text = b"".join(p.read_bytes() for p in sources)
    key = hashlib.sha256(text + ident.encode()).hexdigest()[:16]
    lib = out_dir / f"{stem}-{key}.so"
    if lib.exists():
        return lib
    tmp = out_dir / f".{lib.name}.{os.getpid()}"
    cmd = [cc, *flags, "-shared", "-fPIC", str(sources[0]), "-o", str(tmp), "-lm", "-lpthread"]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, lib)  # atomic: a process beside this one loads a whole file or none
    return lib


def checked(path: Path, check: Callable[[], bool]) -> bool:
    """`check()` (a self-check of the library at `path`) once per built file: the verdict is kept
    beside it (`.ok` / `.bad`), so a later process only loads (the checks took ~0.5 s of every
    start, a third of `localllm run`'s time to first token beyond `import torch`)."""
    ok, bad = path.with_suffix(".ok"), path.with_suffix(".bad")
    if ok.exists() or bad.exists():
        return ok.exists()
    verdict = check()
    with contextlib.suppress(OSError):  # a read-only cache: check again next time
        (ok if verdict else bad).touch()
    return verdict


def built_libraries(
    sources: tuple[Path, ...], flag_sets: tuple[tuple[str, ...], ...], stem: str,
    bind: Callable[[ctypes.CDLL], None], cache_dir: Path | None = None,
    cc: str | None = None,
) -> Iterator[tuple[ctypes.CDLL, Path, tuple[str, ...]]]:  # fmt: skip
    """Each flag set's library that builds, loads and binds (`bind` sets argtypes; a missing
    symbol skips it), fastest first; nothing where no compiler or source is there."""
    cc = cc or compiler()
    if cc is None or not all(p.exists() for p in sources):
        return
    out_dir = Path(cache_dir or tempfile.gettempdir())
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    for flags in flag_sets:
        path = build_library(cc, flags, sources, stem, out_dir)
        if path is None:
            continue
        try:
            lib = ctypes.CDLL(str(path))
            bind(lib)
        except (OSError, AttributeError):
            continue
        yield lib, path, flags
