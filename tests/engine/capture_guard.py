"""What a CUDA graph capture cannot hold, found on the CPU: host reads and host-made tensors in
the region a graph captures.

A capture records the device's work only: a tensor built from Python data and copied over
(`torch.tensor(list, device=...)`), a device value read back (`.item()`, `.tolist()`, `.cpu()`,
`bool()` of a tensor) or an op whose output shape depends on the data (`nonzero`,
`masked_select`, `unique`, a boolean index) either fails the capture ("Cannot copy between CPU
and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned") or bakes one step's
values into every replay. `HostOps` records them while a forward runs: torch's dispatch (what
reaches aten, whatever the device) and function layers (tensor methods that CPU tensors answer
without dispatching). With `cuda_like`, every `Tensor.is_cuda` answers True, so the model takes
the branches it takes on a GPU: its Triton kernels run under TRITON_INTERPRET=1 (their launches
are not recorded: on a GPU a launch is no torch op), PDL off. Use it around exactly the region
that is captured, after an unrecorded run of it (a warm-up prepares lazy weights, as
`cuda_graphs.warm_up` does before a capture).
"""

import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = str(Path(__file__).resolve().parents[2]) + "/"
aten = torch.ops.aten
# aten ops that make a host tensor from Python data, read a value to the host, or shape their
# output by the data
HOST_OPS = {
    aten.lift_fresh.default: "tensor from host data",
    aten.lift_fresh_copy.default: "tensor from host data",
    aten._local_scalar_dense.default: "value read to the host",
    aten.nonzero.default: "data-dependent shape",
    aten.masked_select.default: "data-dependent shape",
    aten._unique2.default: "data-dependent shape",
    aten.unique_dim.default: "data-dependent shape",
    aten.unique_consecutive.default: "data-dependent shape",
}
T = torch.Tensor
# tensor methods a CPU tensor answers without reaching aten (no copy needed on the CPU)
HOST_METHODS = {T.tolist: "tolist", T.cpu: "cpu", T.numpy: "numpy", T.item: "item"}


def _site() -> str:
    """The innermost project frames of the current stack (not this file's)."""
    here = __file__
    frames = [f for f in traceback.extract_stack() if f.filename.startswith(ROOT)]
    frames = [f for f in frames if f.filename != here]
    return " < ".join(f"{f.filename[len(ROOT) :]}:{f.lineno}" for f in frames[-3:][::-1])


def _device_of(args, kwargs) -> bool:
    """Whether a `.to` call names a device (a move, not a dtype change)."""
    if kwargs and kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device)) for a in args[1:])


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "HostOps"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        if o.recording and not o.paused:
            why = HOST_OPS.get(func)
            if why is None and func is aten.index.Tensor:
                bools = [i for i in args[1] if i is not None and i.dtype == torch.bool]
                why = "data-dependent shape (boolean index)" if bools else None
            if why is None and func is aten.repeat_interleave.Tensor:
                why = None if kwargs.get("output_size") is not None else "data-dependent shape"
            if why is not None:
                o.found.append((f"{func} ({why})", _site()))
        return func(*args, **kwargs)


class _Functions(TorchFunctionMode):
    def __init__(self, owner: "HostOps"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        if o.cuda_like and getattr(func, "__self__", None) is T.is_cuda:
            return True
        if o.recording and not o.paused:
            name = HOST_METHODS.get(func)
            if name is None and func in (T.to, T.cuda) and _device_of(args, kwargs):
                name = "device move"  # on a GPU: a host tensor's upload, or a no-op
            if name is not None:
                o.found.append((f"Tensor.{func.__name__} ({name})", _site()))
        return func(*args, **kwargs)


class HostOps:
    """`with HostOps(cuda_like) as h: ...` records into `h.found` [(op, where)] while
    `h.recording` (set it False for a warm-up run)."""

    def __init__(self, cuda_like: bool = False, recording: bool = True):
        self.cuda_like, self.recording = cuda_like, recording
        self.found: list[tuple[str, str]] = []
        self.paused = 0
        self._undo: list = []

    def __enter__(self) -> "HostOps":
        if self.cuda_like:
            self._patch_cuda_like()
        self._modes = (_Functions(self), _Dispatch(self))
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _patch_cuda_like(self) -> None:
        from triton.runtime import interpreter

        from localllm.kernels import pdl

        grid = interpreter.GridExecutor
        launch, enabled = grid.__call__, pdl.enabled
        owner = self

        def unrecorded(executor, *args, **kwargs):  # the interpreter's own tensor work
            owner.paused += 1
            try:
                return launch(executor, *args, **kwargs)
            finally:
                owner.paused -= 1

        grid.__call__ = unrecorded
        pdl.enabled = lambda t: False  # (asks the CUDA runtime for the device's capability)
        self._undo += [lambda: setattr(grid, "__call__", launch),
                       lambda: setattr(pdl, "enabled", enabled)]  # fmt: skip
