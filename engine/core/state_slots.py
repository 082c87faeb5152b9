"""Recurrent-state slots of hybrid models: which slot each running request owns (host ints only).

A stateful model's per-sequence state (`engine.runtime.recurrent_state`) sits in a fixed number
of slots. The KV manager takes a slot for a request when it first allocates for it (admission),
gives it back with the request's blocks (finish, preemption), and for a fork of n > 1 takes one
and records a copy of the sibling's slot, which the runner performs before the step's forward.
"""


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots is {num_slots}, expected at least 1")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._owner: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []  # (src slot, dst slot) not yet performed

    @property
    def num_free(self) -> int:
        return len(self._free)

    def get(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def take(self, request_id: str) -> int | None:
        """The request's slot, taken now if it has none; None when every slot is owned."""
        slot = self._owner.get(request_id)
        if slot is None and self._free:
            slot = self._owner[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> None:
        slot = self._owner.pop(request_id, None)
        if slot is None:
            return
        # a copy into a slot nobody owns any more would only waste time
        self._copies = [c for c in self._copies if c[1] != slot]
        self._free.append(slot)

    def copy(self, src_id: str, dst_id: str) -> bool:
        """dst (a fork) takes a slot holding src's state as it is now; False when src has no
        slot or none is free."""
        src = self._owner.get(src_id)
        dst = self.take(dst_id) if src is not None else None
        if dst is None:
            return False
        self._copies.append((src, dst))
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies recorded since the last call (the runner performs them, in order)."""
        out, self._copies = self._copies, []
        return out
