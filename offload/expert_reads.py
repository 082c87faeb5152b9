"""The host side of experts read at a GPU's request (`expert_reads.c`, compiled at first use):
`ExpertReader` owns the mailbox and the staging rows (page-locked, mapped for the GPU where one
is used), the open files, and the service thread that answers the mailbox; `read_parts` reads
experts on the calling thread for a prompt. The GPU side is `kernels.moe.slot_requests`.
"""

import ctypes
import os
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from localllm.kernels.cpu.cbuild import built_libraries
from localllm.offload.expert_source import ExpertLayout
from localllm.offload.mapped import host_view

SOURCE = Path(__file__).with_name("expert_reads.c")
FLAG_SETS = (("-O2", "-fopenmp"), ("-O2",))  # the last: reads on one thread
BOX_WORDS = 8  # mailbox words before the expert ids (their meaning: expert_reads.c)
BOX_ERR = 4
TIMED_OUT = -2  # BOX_ERR the request kernel writes when the reader did not answer in time
# most threads a request's preads use (fewer where the process has fewer CPUs): a miss waits
# for them; on the H200's 16-core host 16 read the page cache at ~31 GB/s against 8's 24-27
READ_THREADS = 16
CHUNK = 1 << 20  # bytes per pread at most (smaller where that gives every thread a share)
ROW_ALIGN = 256  # staging rows start on this boundary (whole int32 words for the copy kernel)

_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def load_library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled reader, or None where no C compiler builds it (the disk tier then keeps the
    host-driven streamer)."""
    built = built_libraries((SOURCE,), FLAG_SETS, "localllm-expert-reads", _bind, cache_dir)
    return next((lib for lib, _, _ in built), None)


def _bind(lib: ctypes.CDLL) -> None:
    lib.reader_new.argtypes = [_P, _P, _I, _I, _P, _INT, _INT, _I]
    lib.reader_new.restype = _P
    lib.reader_read.argtypes = [_P, _I, _P, _I]
    lib.reader_read.restype = _INT
    lib.reader_start.argtypes, lib.reader_start.restype = [_P], _INT
    for name in ("reader_stop", "reader_free"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [_P], None
    lib.reader_stats.argtypes, lib.reader_stats.restype = [_P, _P], None
    lib.read_segments.argtypes = [_P, _P, _P, _P, _I, _INT, _I]
    lib.read_segments.restype = _INT


def read_threads() -> int:
    """Threads for one request's reads: READ_THREADS, or the CPUs this process may run on."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        cpus = os.cpu_count() or 1
    return max(1, min(READ_THREADS, cpus))


class ExpertReader:
    """Reads experts of `layouts`' layers into `cap` staging rows when the mailbox asks.

    `mapper` turns the mailbox and staging tensors into what the GPU's kernels read (default:
    `offload.mapped.map_tensors`, page-locked and mapped; tests on CPU keep the tensors). `box` and
    `staging` are those views; `box_host` / `staging_host` the host's own. `start()` runs the
    service thread; `check()` raises the error a request met (and clears it). `threads`: how many
    read one request (default `read_threads()`)."""

    def __init__(
        self,
        layouts: Mapping[int, ExpertLayout],
        cap: int,
        lib: ctypes.CDLL,
        mapper: Callable | None = None,
        threads: int | None = None,
    ):
        if cap < 1:
            raise ValueError("an expert reader needs at least one staging row")
        self.layouts, self.cap, self._lib = dict(layouts), cap, lib
        threads = threads or read_threads()
        self.stride = -(-max(lay.expert_nbytes for lay in self.layouts.values()) // ROW_ALIGN)
        self.stride *= ROW_ALIGN
        paths = {r.path for lay in self.layouts.values() for r in lay.ranges}
        self._fds = {p: os.open(p, os.O_RDONLY) for p in paths}
        n_layers = max(self.layouts) + 1
        table = torch.full((n_layers, 10), -1, dtype=torch.int64)
        for layer, lay in self.layouts.items():
            table[layer, 0] = lay.n_expert
            for p, (rng, (rows, rb)) in enumerate(zip(lay.ranges, lay.shapes, strict=True)):
                table[layer, 1 + 3 * p : 4 + 3 * p] = torch.tensor(
                    [self._fds[rng.path], rng.offset, rows * rb]
                )
        if mapper is None:
            from localllm.offload.mapped import map_tensors as mapper
        views = mapper({
            "box": torch.zeros(BOX_WORDS + cap, dtype=torch.int64),
            "staging": torch.zeros(cap, self.stride, dtype=torch.uint8),
        })  # fmt: skip
        self.box, self.staging = views["box"], views["staging"]
        self.box_host, self.staging_host = (host_view(views[k]) for k in ("box", "staging"))
        self._h = lib.reader_new(
            self.box_host.data_ptr(), self.staging_host.data_ptr(), self.stride, cap,
            table.data_ptr(), n_layers, threads, CHUNK,
        )  # fmt: skip
        if not self._h:
            raise MemoryError("the expert reader could not be made")
        self._threads = threads
        self._closer = weakref.finalize(self, _close, lib, self._h, list(self._fds.values()))

    def start(self) -> None:
        err = self._lib.reader_start(self._h)
        if err:
            raise OSError(err, "the expert reader thread did not start")

    def read(self, layer: int, experts: list[int]) -> None:
        """Experts of `layer` into staging rows 0.. on this thread (tests; no GPU involved)."""
        ids = torch.tensor(experts, dtype=torch.int64)
        self._raise(self._lib.reader_read(self._h, layer, ids.data_ptr(), len(experts)))

    def read_parts(self, layer: int, experts: list[int], out: tuple[torch.Tensor, ...]) -> None:
        """Experts of `layer` into three host tensors (gate, up, down; uint8 [>= n, bytes of
        that part]), row i for experts[i], on this thread and the reader's OpenMP threads."""
        lay = self.layouts[layer]
        fds, offs, lens, dsts = [], [], [], []
        for i, e in enumerate(experts):
            for p, rng in enumerate(lay.expert_ranges(e)):
                if out[p].shape[1] < rng.nbytes or not out[p].is_contiguous():
                    raise ValueError("read_parts needs contiguous rows that hold each part")
                fds.append(self._fds[rng.path])
                offs.append(rng.offset)
                lens.append(rng.nbytes)
                dsts.append(out[p][i].data_ptr())
        n = len(fds)
        arr = (ctypes.c_int * n)(*fds), (_I * n)(*offs), (_I * n)(*lens), (_P * n)(*dsts)
        chunk = max(64 << 10, min(CHUNK, sum(lens) // max(1, self._threads)))
        self._raise(self._lib.read_segments(*arr, n, self._threads, chunk))

    def _raise(self, err: int) -> None:
        if err == -1:
            raise ValueError("an expert read asked for a layer or expert the reader does not have")
        if err:
            raise OSError(err, f"reading experts failed: {os.strerror(err)}")

    def check(self) -> None:
        """Raise the error the last requests met, if any (cleared: later requests run again)."""
        err = int(self.box_host[BOX_ERR])
        if not err:
            return
        self.box_host[BOX_ERR] = 0
        if err == TIMED_OUT:
            raise TimeoutError("the expert reader did not answer the GPU's request")
        self._raise(err)

    def stats(self) -> tuple[int, int, int, float]:
        """(requests answered, experts read, bytes read, seconds reading) so far."""
        out = torch.zeros(4, dtype=torch.int64)
        self._lib.reader_stats(self._h, out.data_ptr())
        req, experts, nbytes, ns = out.tolist()
        return req, experts, nbytes, ns / 1e9

    def close(self) -> None:
        self._closer()


def _close(lib: ctypes.CDLL, handle: int, fds: list[int]) -> None:
    lib.reader_free(handle)  # stops the thread first
    for fd in fds:
        os.close(fd)
