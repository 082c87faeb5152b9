"""Decode one step ahead: the next decode step is launched before this step's tokens reach the
host, fed this step's tokens on the device, so the GPU runs it while the host samples,
detokenizes and schedules. Without it the GPU idles for all of that every token (~0.5 ms on the
H200, a fifth of a fast model's step). Rows qualify when the device picks their token itself:
greedy, or drawn there (`engine.sampling.device`).

A launched step is used only when the scheduler then asks for exactly it (the same requests at
the same positions, fed the tokens the host got); otherwise it is dropped unread and the
generators its draw advanced are put back. Dropping is safe: the token it was fed is the one that
follows, so the KV it wrote at the next position is what the real step would write, and a freed
block's next owner writes after it in stream order.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from localllm.engine.sampling.device import DeviceDraw, tokens
from localllm.engine.sampling.params import SamplingParams

# (request id, position) per row: the step a launch computes
StepKey = tuple[tuple[str, int], ...]
# inputs [n, COLS + w] on the host, device ids for column 0 (None: the inputs' own), and what to
# queue behind the replay -> its result, or None where the shape runs eager (`DecodeGraphs.run`)
Launch = Callable[[torch.Tensor, torch.Tensor | None, Callable], "Staged | None"]
Drawer = Callable[[], DeviceDraw | None]  # a step's sampled rows, drawn when it is launched


@dataclass(slots=True)
class Staged:
    """A launched step's tokens on their way to the host."""

    key: StepKey
    ids: torch.Tensor  # [n] int64 on the device: feeds the step after
    host: torch.Tensor  # [2, n] float64 (maxima, tokens) on the host, valid once `done` is set
    done: torch.cuda.Event | None  # None on a CPU: computed already
    draw: DeviceDraw | None = None  # its sampled rows' draw
    fed: list[int] | None = None  # the tokens it was fed, known once the step before is read

    def read(self) -> tuple[list[float], list[int]]:
        if self.done is not None:
            self.done.synchronize()
        maxima, ids = self.host.tolist()
        return maxima, [int(t) for t in ids]


def stage(key: StepKey, logits: torch.Tensor, draw: DeviceDraw | None = None) -> Staged:
    """The rows' maxima and tokens (`Sampler`'s answer for such rows) copied to the host behind
    the step, the tokens kept on the device to feed the next step."""
    best, ids = tokens(logits, draw)
    pair = torch.stack((best.double(), ids.double()))  # float64: any vocabulary's ids exact
    if logits.device.type != "cuda":
        return Staged(key, ids, pair, None, draw)
    host = torch.empty(pair.shape, dtype=pair.dtype, pin_memory=True)
    host.copy_(pair, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return Staged(key, ids, host, done, draw)


def warm_up(vocab: int, device: torch.device) -> None:
    """Launch every kernel `stage` does (argmax rows, drawn rows with every control on, both
    mixed) once, before any decode replay. A kernel's first launch loads its module, and CUDA
    may synchronize the context to load one (its lazy loading); behind a split decode step the
    device waits for CPU shares the host runs only after `stage` returns, so a load there would
    wait on a wait for itself."""
    x = torch.zeros(2, vocab, device=device)
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)
    gens = [torch.Generator(), torch.Generator()]
    for draw in (None, DeviceDraw.draw([0, 1], [p, p], gens), DeviceDraw.draw([1], [p], gens[:1])):
        stage((), x, draw).read()


class DecodeAhead:
    """Keeps at most one launched step that no one has asked for yet."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.pending: Staged | None = None
        self.launched = self.used = self.dropped = 0  # steps launched ahead, used, dropped

    def take(self, key: StepKey, ids: list[int]) -> Staged | None:
        """The pending step if it is exactly this one (then it is no longer pending), else None
        (and any pending step is dropped)."""
        p, self.pending = self.pending, None
        if p is not None and p.key == key and p.fed == ids:
            self.used += 1
            return p
        self.drop(p)
        return None

    def drop(self, p: Staged | None = None) -> None:
        """Forget a launched step (its device work runs on; nothing reads it) and put back the
        generators its draw advanced."""
        p = self.pending if p is None else p
        if p is not None:
            self.dropped += 1
            if p.draw is not None:
                p.draw.restore()
        self.pending = None

    def run(
        self, key: StepKey, inputs: Callable[[], torch.Tensor], ids: list[int], draw: Drawer
    ) -> Staged | None:
        """This step's staged answer: the pending one when it matches, else launched now (its
        rows drawn by `draw()`, its inputs made by `inputs()`: a pending step needs none, and at
        64 sequences they cost the host a millisecond); None when its shape runs eager (nothing
        launched or drawn)."""
        cur = self.take(key, ids)
        if cur is None:
            cur = self.launch(inputs(), None, lambda logits: stage(key, logits, draw()))
        return cur

    def ahead(self, cur: Staged, key: StepKey, inputs: torch.Tensor, draw: Drawer) -> None:
        """Launch the step after `cur`, fed its tokens on the device (column 0 of `inputs` is
        ignored); it waits in `pending` until asked for."""
        self.pending = self.launch(inputs, cur.ids, lambda logits: stage(key, logits, draw()))
        self.launched += self.pending is not None

    def read(self, cur: Staged) -> tuple[list[float], list[int]]:
        """`cur`'s maxima and tokens on the host; the pending step learns what it was fed."""
        maxima, ids = cur.read()
        if self.pending is not None:
            self.pending.fed = ids
        return maxima, ids
