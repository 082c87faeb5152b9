"""Page-locked staging buffers for expert reads bound for a device.

A read lands in a staging buffer, then one copy that does not wait (`non_blocking`) takes it to
the device; the buffer may be written again only once that copy has run. `StagingRing` hands its
buffers out round-robin, each after the CUDA event recorded behind its last copy, so reads of
many experts (a layer's misses, the prefetch thread's guesses) overlap the uploads before them.
"""

import threading

import torch


class StagingRing:
    """`n` buffers of `nbytes`, page-locked when `pin` (for CUDA); `take` one, read into it,
    queue its copy to the device, `give` it back."""

    def __init__(self, n: int, nbytes: int, pin: bool):
        if n < 1:
            raise ValueError("a staging ring needs at least one buffer")
        self.buffers = torch.empty(n, nbytes, dtype=torch.uint8, pin_memory=pin)
        self.views = [memoryview(self.buffers[i].numpy()) for i in range(n)]
        self._pin = pin
        self._events: list = [None] * n  # behind each buffer's last copy (None: none queued)
        self._busy: set[int] = set()
        self._next = 0
        self._lock = threading.Lock()  # the foreground and the prefetch thread both take

    def take(self) -> int:
        """A buffer nobody holds, once the copy that last read it has finished."""
        n = len(self._events)
        with self._lock:
            for _ in range(n):
                i, self._next = self._next, (self._next + 1) % n
                if i not in self._busy:
                    self._busy.add(i)
                    event = self._events[i]
                    break
            else:
                raise RuntimeError(f"all {n} staging buffers are in use")
        if event is not None:
            event.synchronize()
        return i

    def give(self, i: int) -> None:
        """Buffer `i` back, its copy to the device queued on this thread's current stream."""
        event = None
        if self._pin:
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            self._events[i] = event
            self._busy.discard(i)
