"""A decode graph whose split layers (`engine.moe.split`) hand their rows to the CPU and back
through flags in page-locked host memory, with no break in the graph.

Handing over at a graph break costs, every layer, the host's return from the CPU's share, a
graph launch and the first kernel's start between the CPU's last store and the GPU's next step
(~110-160 us a layer on the H200 host against a CPU share of ~230). Here the decode step is one
graph; per split layer it holds a `hand_out` kernel (the token rows and the CPU's routing stored
into the layer's mapped buffers, then its GPU flag := this replay's number), the GPU's share and
a `take_back` kernel (until the layer's CPU flag holds the number, then the GPU's sum plus the
CPU's, read over the bus; `kernels.host_flags`).
The host launches the replay, then runs the CPU's shares in layer order in one native call
(`run`, `kernels.cpu.split_run`): per layer it spins on the GPU flag, computes, sets the CPU
flag.

A host that fails half-way sets every flag left (the GPU finishes the step on stale sums, the
caller gets the error); a host that never comes lets the GPU's waits give up after about a
second each, which the next `arm` raises.
"""

import dataclasses
from dataclasses import dataclass

import torch

from localllm.engine.moe import split as moe_split
from localllm.kernels.cpu.native import NativeKernels
from localllm.kernels.cpu.split_run import SplitRun, SplitSpec
from localllm.offload.mapped import host_view, map_empty

HOST_TIMEOUT_US = 10_000_000  # the host's wait for a layer's rows (what was queued first runs)


class SplitLinkError(RuntimeError):
    """The GPU and the CPU lost each other in a linked decode step."""


class SplitLink:
    """Flags and jobs of one captured decode graph: `add` / `hold` while capturing (in layer
    order), then per replay `arm()` before it and `run()` after its launch."""

    def __init__(self, native: NativeKernels, n: int, device: torch.device) -> None:
        """`n` split layers; on a CPU `device` (tests) the flags are plain host tensors and the
        GPU's side is the caller's to play (`add` and `hold` capture nothing)."""
        self.native, self.kernels = native, None
        self._run: SplitRun | None = None  # laid out at the first replay
        self.jobs: list[tuple[object, int]] = []  # (SplitExperts, token rows) per captured layer
        spec = {"gpu": ((n,), torch.int32), "cpu": ((n,), torch.int32), "err": ((1,), torch.int32)}
        cuda = device.type == "cuda"
        if cuda:
            self.flags = map_empty(spec, device)
        else:
            self.flags = {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in spec.items()}
        for v in self.flags.values():
            host_view(v).zero_()
        self._gpu = host_view(self.flags["gpu"]).data_ptr()
        self._cpu = host_view(self.flags["cpu"]).data_ptr()
        self._err = host_view(self.flags["err"])
        self.seq = 0
        self.seq_dev = torch.zeros(1, dtype=torch.int32, device=device)
        self.waits = torch.zeros(n, dtype=torch.int32, device=device)
        if cuda:  # compiled here: a first launch inside the capture would load modules mid-way
            from localllm.kernels import host_flags

            self.kernels = host_flags

            def z(n, dtype=torch.float32):
                return torch.zeros((1, n), dtype=dtype, device=device)

            outs, err = (z(16), z(1), z(1, torch.int64)), self.flags["err"]
            host_flags.hand_out(z(16), z(2), z(2, torch.int64), 1, outs, self.flags["gpu"], 0,
                                self.seq_dev)  # fmt: skip
            host_flags.take_back(z(16), z(16), self.flags["gpu"], 0, self.seq_dev, self.waits, err)
            torch.cuda.synchronize(device)
            self.waits.zero_()
            host_view(self.flags["gpu"]).zero_()

    def hand_out(self, split, x, weights, ids, g: int) -> int:
        """Capture the next split layer's hand-over: its token rows `x` [t, dim] and the CPU's
        routing (`weights` / `ids` [t, k] from column `g`) into the layer's mapped buffers,
        then its flag (one kernel); on a CPU device, the copies alone. Returns the layer's
        index for `take_back`."""
        i, t = len(self.jobs), x.shape[0]
        if i >= self.waits.numel():
            raise SplitLinkError(f"more split layers than the {self.waits.numel()} planned")
        self.jobs.append((split, t))
        if self.kernels is None:
            split._rows[:t].copy_(x)
            split._w[:t].copy_(weights[:, g:])
            split._ids[:t].copy_(ids[:, g:])
            return i
        m = split.mapped
        out = (m["rows"][:t], m["w"][:t], m["ids"][:t])
        self.kernels.hand_out(x, weights, ids, g, out, self.flags["gpu"], i, self.seq_dev)
        return i

    def take_back(self, i: int, yg: torch.Tensor) -> torch.Tensor:
        """Capture layer `i`'s wait for the CPU's share and the sum `yg` + that share (one
        kernel); on a CPU device, the sum alone."""
        split, t = self.jobs[i]
        if self.kernels is None:
            return yg + split._y[:t]
        y, err = split.mapped["y"][:t], self.flags["err"]
        return self.kernels.take_back(yg, y, self.flags["cpu"], i, self.seq_dev, self.waits, err)

    def arm(self) -> None:
        """Before a replay: its number, on the device in stream order. A GPU that gave up
        waiting in an earlier step is raised here, once (that step's output was wrong)."""
        if int(self._err[0]):
            self._err[0] = 0
            raise SplitLinkError("the GPU gave up waiting for the CPU's share of a split layer")
        self.seq = self.seq % (2**31 - 1) + 1
        self.seq_dev.fill_(self.seq)

    def release(self) -> None:
        """Set every CPU flag to this replay's number: a replay whose host side will not run
        (its launch failed) leaves the GPU no wait."""
        for i in range(len(self.jobs)):
            self.native.lib.flag_set(self._cpu + 4 * i, self.seq)

    def run(self) -> None:
        """After the replay's launch: every split layer's CPU share, in order, in one native
        call (`kernels.cpu.split_run`; see the module)."""
        if self._run is None:  # (after the capture: every layer is known)
            specs = []
            for i, (s, t) in enumerate(self.jobs):
                bufs = (b.data_ptr() for b in (s._rows, s._w, s._ids, s._y))
                specs.append(SplitSpec(s.call, t, self._gpu + 4 * i, self._cpu + 4 * i, *bufs))
            self._run = SplitRun(self.native, specs)
        threads = moe_split.SPLIT_THREADS or torch.get_num_threads()
        bad = self._run(self.seq, HOST_TIMEOUT_US, threads)
        done = len(self.jobs) if bad == -1 else bad if bad >= 0 else -2 - bad  # layers that ran
        times = self._run.timings()[:done]
        for (split, t), (waited, computing) in zip(self.jobs[:done], times, strict=True):
            split.count(t, waited, computing)
        if bad >= 0:
            raise SplitLinkError(f"split layer {bad}: the GPU's rows never came")
        if bad < -1:  # (the layer that failed is the first that did not run)
            raise SplitLinkError(f"split layer {done}: an expert id out of range")

    def gpu_waits(self) -> int:
        """Layer steps in which the GPU waited for the CPU's share (it was the longer side)."""
        return int(self.waits.sum())


@dataclass(frozen=True)
class SplitBalance:
    """How a model's split layers' steps went (sums since the model loaded; `minus` for a
    window): which side waited for the other tells which way `split_share` should move."""

    cpu_experts: tuple[int, ...]  # each split layer's CPU experts per token
    n_used: int
    steps: int  # layer steps whose CPU share ran
    wait_s: float  # the host's waits for the GPU's rows
    cpu_s: float  # the CPU's shares
    gpu_waits: int  # linked steps in which the GPU's wait kernel had to spin

    def minus(self, before: "SplitBalance") -> "SplitBalance":
        return dataclasses.replace(
            self,
            steps=self.steps - before.steps,
            wait_s=self.wait_s - before.wait_s,
            cpu_s=self.cpu_s - before.cpu_s,
            gpu_waits=self.gpu_waits - before.gpu_waits,
        )

    def line(self) -> str:
        lo, hi = min(self.cpu_experts), max(self.cpu_experts)
        share = f"{lo}" if lo == hi else f"{lo}-{hi}"
        n = max(self.steps, 1)
        return (
            f"the CPU computed {share} of each token's {self.n_used} experts in "
            f"{len(self.cpu_experts)} layers; a layer step waited {self.wait_s / n * 1e6:.0f} us "
            f"for the rows and computed {self.cpu_s / n * 1e6:.0f} us; the GPU waited for the "
            f"CPU in {self.gpu_waits / n:.0%} of them (often: a lower --split-share may pay; "
            "rarely, with long waits for the rows: a higher one)"
        )


def split_balance(blocks, links) -> SplitBalance | None:
    """The split layers among `blocks` (MoE blocks) and the decode graphs' `links`; None
    without split layers."""
    split = [b.split for b in blocks if b.split is not None]
    if not split:
        return None
    return SplitBalance(
        tuple(s.cpu for s in split),
        split[0].n_used,
        sum(s.timing.steps for s in split),
        sum(s.timing.wait_seconds for s in split),
        sum(s.timing.cpu_seconds for s in split),
        sum(link.gpu_waits() for link in links),
    )
