"""Per-sequence recurrent state of hybrid models: fixed slots beside the paged KV cache.

Hybrid families (LFM2's short convolutions, Granite 4's Mamba-2, Qwen3-Next's gated DeltaNet)
carry a fixed-size state per sequence instead of (or beside) a KV history. The state lives in
slots: every stateful layer holds, per state name, one tensor `[num_slots, *shape]` (float32).
A running sequence owns one slot for its whole life (`engine.core.state_slots`, through the KV
manager): taken at admission, given back at finish or preemption, copied into a fork's slot for
n > 1. A sequence whose step starts at position 0 starts from zeros: a layer never sees what a
slot's previous owner left (so slots are never cleared, and preempt-and-resume recomputes).

How a model family declares its state (the one contract with this module):

    class Model(nn.Module):
        def state_shapes(self) -> dict[int, dict[str, tuple[int, ...]]]:
            # block index -> state name -> one sequence's shape (float32)
            return {i: {"conv": (d_conv - 1, channels), "ssm": (heads, head_dim, d_state)}
                    for i in self.recurrent_layers}

A model without the method (or returning {}) keeps no state. The engine (and `Generator`, the
tests, bench) calls `attach_states(kv, model, num_slots)` after building its `PagedKVCache`; a
stateful layer then reads and writes through `states_of(kv)`:

    st = states_of(kv)
    conv = st.read(layer, "conv", batch)   # [B, *shape]: each sequence's state, zeros if fresh
    ...                                     # (the step's tokens of sequence b: batch.query_start)
    st.write(layer, "conv", batch, conv)    # store [B, *shape] back into the sequences' slots

Kernels that update the state in place use `st.tensor(layer, name)` ([num_slots + 1, *shape]),
`st.slots(batch)` (int64 [B] on the device) and `st.fresh(batch)` (bool [B] on the device).
Which slot a sequence owns comes from `BatchMeta.state_slots` (the runner fills it); a batch
that leaves it empty (one-off callers: `Generator`, tests) uses slots 0..B-1.

One slot more than `num_slots` is kept, `scratch`, owned by nobody: a decode CUDA graph's padding
rows (`engine.runtime.cuda_graphs`) read it as fresh and write their garbage there, so they never
race a real sequence on its slot. A captured graph reads the slots and freshness from its static
inputs (`slots` and `fresh` are found in `batch.plans`, built there from device tensors).
"""

from collections.abc import Mapping

import torch

STATE_DTYPE = torch.float32  # recurrences accumulate over the whole sequence: kept in float32
STATE_SLOTS, STATE_FRESH = ("state_slots",), ("state_fresh",)  # their `BatchMeta.plans` keys

StateShapes = Mapping[int, Mapping[str, tuple[int, ...]]]


def state_shapes(model) -> dict[int, dict[str, tuple[int, ...]]]:
    """The model's declared state shapes (`{}` for a model without recurrent layers)."""
    declare = getattr(model, "state_shapes", None)
    return {} if declare is None else {i: dict(s) for i, s in declare().items() if s}


def state_bytes(shapes: StateShapes, num_slots: int = 1) -> int:
    """Bytes the state of `num_slots` sequences takes over all layers (the scratch slot that
    `RecurrentState` adds not counted: see `slot_pool_bytes`)."""
    size = torch.tensor([], dtype=STATE_DTYPE).element_size()
    return num_slots * sum(size * _numel(s) for layer in shapes.values() for s in layer.values())


def slot_pool_bytes(shapes: StateShapes, num_slots: int) -> int:
    """Bytes a `RecurrentState` of `num_slots` slots holds: theirs and the scratch slot's."""
    return state_bytes(shapes, num_slots + 1) if shapes else 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class RecurrentState:
    """The state tensors of every stateful layer, `num_slots` sequences each."""

    def __init__(self, shapes: StateShapes, num_slots: int, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"num_slots is {num_slots}: a stateful model needs at least one slot")
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.scratch = num_slots  # the padding rows' slot (graphs), never handed out
        self.shapes = {i: dict(s) for i, s in shapes.items()}
        # empty, not zeros: a slot is only read once its owner wrote it (a fresh sequence reads
        # zeros through `read`, a fork copies a sibling that computed its prompt), and untouched
        # pages of many slots then cost no memory until used
        self._t = {
            i: {
                name: torch.empty(num_slots + 1, *shape, dtype=STATE_DTYPE, device=self.device)
                for name, shape in layer.items()
            }
            for i, layer in self.shapes.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self._t.values() for t in d.values())

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        """All slots' state `name` of `layer`: [num_slots + 1, *shape] (the last: scratch)."""
        try:
            return self._t[layer][name]
        except KeyError:
            raise KeyError(f"layer {layer} declared no state {name!r}") from None

    def slots(self, batch) -> torch.Tensor:
        """Each sequence's slot, int64 [B] on the device (built once per step)."""
        key = STATE_SLOTS
        if key not in batch.plans:
            ids = batch.state_slots or tuple(range(batch.num_seqs))
            if len(ids) != batch.num_seqs:
                raise ValueError(f"{len(ids)} state slots for {batch.num_seqs} sequences")
            if max(ids) >= self.num_slots:
                raise ValueError(f"state slot {max(ids)} beyond the {self.num_slots} slots")
            batch.plans[key] = torch.tensor(ids, dtype=torch.long).to(self.device)
        return batch.plans[key]

    def fresh(self, batch) -> torch.Tensor:
        """Whether each sequence's step starts at position 0 (its state starts from zeros),
        bool [B] on the device."""
        key = STATE_FRESH
        if key not in batch.plans:
            if batch.context is not None:
                raise ValueError("a device-context batch (a prompt graph) carries no state slots")
            qs = batch.query_start
            starts = [n - (qs[b + 1] - qs[b]) for b, n in enumerate(batch.seq_lens)]
            batch.plans[key] = torch.tensor([s == 0 for s in starts]).to(self.device)
        return batch.plans[key]

    def read(self, layer: int, name: str, batch) -> torch.Tensor:
        """The batch's sequences' state [B, *shape] (a copy): zeros for a fresh sequence."""
        t = self.tensor(layer, name)
        got = t.index_select(0, self.slots(batch))
        # where, not a product: a slot's previous owner may have left inf or NaN
        fresh = self.fresh(batch).view(-1, *([1] * (t.dim() - 1)))
        return torch.where(fresh, torch.zeros((), dtype=got.dtype, device=got.device), got)

    def write(self, layer: int, name: str, batch, value: torch.Tensor) -> None:
        """Store the sequences' new state [B, *shape] into their slots."""
        t = self.tensor(layer, name)
        t.index_copy_(0, self.slots(batch), value.to(t.dtype))

    def copy(self, src: int, dst: int) -> None:
        """Slot dst takes slot src's state in every layer (a fork of n > 1)."""
        for layer in self._t.values():
            for t in layer.values():
                t[dst].copy_(t[src])


def attach_states(kv, model, num_slots: int) -> RecurrentState | None:
    """Give `kv` (a `PagedKVCache`) the model's state slots; None for a model without state."""
    shapes = state_shapes(model)
    kv.states = RecurrentState(shapes, num_slots, kv.device) if shapes else None
    return kv.states


def states_of(kv) -> RecurrentState:
    """The state slots a stateful layer reads, or a clear error where none were attached."""
    st = getattr(kv, "states", None)
    if st is None:
        raise RuntimeError(
            "this model keeps recurrent state per sequence, but its KV cache has no state slots "
            "(engine.runtime.recurrent_state.attach_states)"
        )
    return st
