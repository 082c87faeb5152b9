"""Decode one step ahead: the next greedy decode step is launched before this step's tokens reach
the host, fed this step's argmax on the device, so the GPU runs it while the host samples,
detokenizes and schedules. Without it the GPU idles for all of that every token (~0.6 ms on the
H200, a quarter of a fast model's step).

A launched step is used only when the scheduler then asks for exactly it (the same requests at
the same positions, fed the tokens the host got); otherwise it is dropped unread. Dropping is
safe: greedy decoding makes the token it was fed the one that follows, so the KV it wrote at the
next position is what the real step would write, and a freed block's next owner writes after it
in stream order.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (request id, position) per row: the step a launch computes
StepKey = tuple[tuple[str, int], ...]
# inputs [n, COLS + w] on the host, device ids for column 0 (None: the inputs' own) -> logits
Launch = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor | None]


@dataclass(slots=True)
class Staged:
    """A launched step's greedy answer on its way to the host."""

    key: StepKey
    ids: torch.Tensor  # [n] int64 on the device: feeds the step after
    host: torch.Tensor  # [2, n] float64 (maxima, argmax) on the host, valid once `done` is set
    done: torch.cuda.Event | None  # None on a CPU: computed already
    fed: list[int] | None = None  # the tokens it was fed, known once the step before is read

    def read(self) -> tuple[list[float], list[int]]:
        if self.done is not None:
            self.done.synchronize()
        maxima, ids = self.host.tolist()
        return maxima, [int(t) for t in ids]


def stage(key: StepKey, logits: torch.Tensor) -> Staged:
    """The rows' maxima and argmax (`Sampler`'s plain greedy answer) copied to the host behind
    the step, and the argmax kept on the device to feed the next step."""
    best, ids = logits.detach().float().max(-1)
    pair = torch.stack((best.double(), ids.double()))  # float64: any vocabulary's ids exact
    if logits.device.type != "cuda":
        return Staged(key, ids, pair, None)
    host = torch.empty(pair.shape, dtype=pair.dtype, pin_memory=True)
    host.copy_(pair, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return Staged(key, ids, host, done)


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
        """Forget a launched step (its device work runs on; nothing reads it)."""
        p = self.pending if p is None else p
        if p is not None:
            self.dropped += 1
        self.pending = None

    def run(self, key: StepKey, inputs: torch.Tensor, ids: list[int]) -> Staged | None:
        """This step's staged answer: the pending one when it matches, else launched now; None
        when its shape runs eager (nothing launched)."""
        cur = self.take(key, ids)
        if cur is None:
            logits = self.launch(inputs, None)
            if logits is None:
                return None
            cur = stage(key, logits)
        return cur

    def ahead(self, cur: Staged, key: StepKey, inputs: torch.Tensor) -> None:
        """Launch the step after `cur`, fed its argmax on the device (column 0 of `inputs` is
        ignored); it waits in `pending` until asked for."""
        logits = self.launch(inputs, cur.ids)
        if logits is None:
            return
        self.pending = stage(key, logits)
        self.launched += 1

    def read(self, cur: Staged) -> tuple[list[float], list[int]]:
        """`cur`'s maxima and argmax on the host; the pending step learns what it was fed."""
        maxima, ids = cur.read()
        if self.pending is not None:
            self.pending.fed = ids
        return maxima, ids
