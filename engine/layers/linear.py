"""Keep-quant linear layers: `QuantLinear` (one GGUF weight, multiplied by its prepared kernel
while it stays in its ggml encoding) and `FusedLinear` (several weights that read one input, run
as few matmuls over stacked rows), plus the small-tensor helpers `dense` and `without_bytes`.
"""

import dataclasses
import math

import torch
from torch import nn

from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.linear import prepare_linear, prepare_parts
from localllm.offload import QuantWeight


def dense(w: QuantWeight) -> torch.Tensor:
    """A small tensor (norm weights, biases) expanded to float32 in its logical shape."""
    return dequantize(w.data, w.qtype).reshape(w.shape)


def without_bytes(w: QuantWeight, device: torch.device | None = None) -> QuantWeight:
    """`w` with a zero-storage stand-in of the same shape for its data (on `device`, default its
    own): the metadata (type, shape, byte count, source range) stays for residency accounting;
    the bytes live in a kernel layout."""
    stub = torch.zeros(1, dtype=torch.uint8, device=device or w.data.device).expand(w.data.shape)
    return dataclasses.replace(w, data=stub)


class QuantLinear(nn.Module):
    """y = x @ W.T (+ b) with W kept as raw ggml blocks; the kernel dequantizes in the matmul."""

    def __init__(self, in_features: int, out_features: int, precise: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.precise = precise
        self.weight: QuantWeight | None = None
        self.bias: torch.Tensor | None = None
        self._prepared = None
        self.native = None  # the native CPU kernels, set by the loader before the weights come
        # the GPU the weight belongs on: the loader passes host blocks, uploaded here only for
        # the kernel (a re-laid-out kernel then holds the only device copy)
        self.home: torch.device | None = None
        self.lora = None  # an `engine.lora` LoraDelta hung on after loading (None: base alone)

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix == "bias":
            if math.prod(w.shape) != self.out_features:
                raise ValueError(f"expected a bias of {self.out_features}, got {tuple(w.shape)}")
            self.bias = dense(w).reshape(self.out_features)
            return
        if suffix != "weight":
            raise KeyError(suffix)
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"expected shape {(self.out_features, self.in_features)}, got {tuple(w.shape)}"
            )
        data = w.data if self.home is None else w.data.to(self.home)
        self._prepared = prepare_linear(
            data, w.qtype, w.shape, precise=self.precise, native=self.native
        )
        # (re-laid out: the upload goes now, not after the whole load; the weight keeps the
        # host blocks, the file's mapping, for a FusedLinear to stack)
        host = self.home is not None and getattr(self._prepared, "repacked", False)
        self.weight = w if host else dataclasses.replace(w, data=data)

    @property
    def loaded(self) -> bool:
        return self.weight is not None

    def kernels(self) -> list:
        """The prepared kernel weights this module multiplies by (none once a FusedLinear does)."""
        return [self._prepared] if self._prepared is not None else []

    def release_kernel(self) -> None:
        """Drop the prepared kernel weight once a FusedLinear computes this layer."""
        self._prepared = None

    def dense_weight(self) -> torch.Tensor | None:
        """The float32 W [N, K] the kernel multiplies by, when it keeps one (else None)."""
        w = getattr(self._prepared, "w", None)
        return w if isinstance(w, torch.Tensor) and w.dtype == torch.float32 else None

    @property
    def takes_quantized(self) -> bool:
        """Whether `forward` reads an `xq` (its dp4a GEMVs of packed weights on CUDA)."""
        p = self._prepared
        return p is not None and p.kind == "triton" and getattr(p, "repacked", False)

    def drop_raw_copy(self) -> None:
        """Free the raw copy once a GPU kernel holds the bytes in its own layout (call after
        fusing: FusedLinear stacks raw rows). The QuantWeight keeps its shape and byte count."""
        if self.weight is None:  # an optional tensor the file does not have
            return
        on_gpu = self.home is not None or self.weight.data.device.type != "cpu"
        if getattr(self._prepared, "repacked", False) and on_gpu:
            self.weight = without_bytes(self.weight, self.home)

    def forward(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        """`xq`: x's rows already quantized by the kernel that made x (see `kernels.fused`)."""
        x2 = x.reshape(-1, self.in_features)
        tails = self.lora.tails(x2) if self.lora is not None else None  # (its shrink launched)
        y = _matmul(self._prepared, x2, xq, tails[0] if tails else None)
        if self.lora is not None and tails is None:
            y = self.lora.add(x2, y)
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is None:
            return y
        # into the matmul's own fresh output: a prompt-sized second tensor is a new mapping
        # page-faulted afresh on a CPU (a SigLIP tower's bias adds: 0.32 of 3.4 s)
        return y.add_(self.bias) if y.dtype == self.bias.dtype else y + self.bias


def _matmul(prepared, x: torch.Tensor, xq, tail=None) -> torch.Tensor:
    # only the triton kernels take pre-quantized rows; the others ignore the twin. `tail`: a
    # LoRA expand the packed GEMV adds in its epilogue (`LoraDelta.tails`)
    if tail is not None:
        return prepared.matmul(x, xq, lora=tail)
    if xq is not None and prepared.kind == "triton":
        return prepared.matmul(x, xq)
    return prepared.matmul(x)


class FusedLinear(nn.Module):
    """Several QuantLinears that read the same input, run as few matmuls over stacked rows.

    Consecutive parts of one ggml type share one kernel weight (q/k/v: one call instead of three;
    gate/up: one instead of two); parts of another type (Q4_K_M's Q6_K attn_v) get their own,
    and all share the input's quantization on CUDA. The parts keep their QuantWeights (residency
    still sees every GGUF tensor). Stacking raw ggml rows is exact: blocks never straddle rows.
    """

    def __init__(self, parts: list[QuantLinear]):
        super().__init__()
        self.sizes = [p.out_features for p in parts]
        self.parts = tuple(parts)  # (not submodules: their owner registers them)
        self.lora = None  # an `engine.lora` LoraDelta over the parts (None: base alone)
        self.in_features = parts[0].in_features
        self._groups: list[tuple[object, list[int]]] = []  # (kernel weight, part sizes)
        i = 0
        while i < len(parts):
            j = i + 1
            while j < len(parts) and parts[j].weight.qtype == parts[i].weight.qtype:
                j += 1
            self._groups.append((self._stack(parts[i:j]), self.sizes[i:j]))
            i = j
        device = parts[0].home or parts[0].weight.data.device
        biases = [
            p.bias if p.bias is not None else torch.zeros(p.out_features, device=device)
            for p in parts
        ]
        has_bias = any(p.bias is not None for p in parts)
        self.bias = torch.cat(biases) if has_bias else None
        for p in parts:
            p.release_kernel()

    @staticmethod
    def _stack(parts: list[QuantLinear]):
        w0 = parts[0].weight
        shape = (sum(p.out_features for p in parts), parts[0].in_features)
        if parts[0].home is None:  # native CPU kernels read the parts where they lie: no copy
            datas = [p.weight.data for p in parts]
            kept = prepare_parts(datas, w0.qtype, shape, parts[0].precise, parts[0].native)
            if kept is not None:
                return kept
        data = torch.cat([p.weight.data for p in parts])
        if parts[0].home is not None:  # (re-laid-out parts keep host blocks: stacked there)
            data = data.to(parts[0].home)
        prepared = prepare_linear(
            data, w0.qtype, shape, precise=parts[0].precise, native=parts[0].native
        )
        if getattr(prepared, "repacked", False) and data.device.type != "cpu":
            for p in parts:  # the kernel holds the only device copy, in its own layout
                p.weight = without_bytes(p.weight)
        elif data.device.type != "cpu":  # the parts view the stacked upload: one copy on the GPU
            for p, rows in zip(parts, data.split([p.out_features for p in parts]), strict=True):
                p.weight = dataclasses.replace(p.weight, data=rows)
        return prepared

    @staticmethod
    def fusable(parts: list[QuantLinear], mixed: bool = False) -> bool:
        """Loaded parts with one input size; of one ggml type unless `mixed` (then the types may
        differ: one kernel weight per run of equal types)."""
        w = [p.weight for p in parts]
        if not all(x is not None for x in w):
            return False
        same = mixed or all(x.qtype == w[0].qtype for x in w)
        return same and all(p.in_features == parts[0].in_features for p in parts)

    def kernels(self) -> list:
        return [k for k, _ in self._groups]

    def groups(self) -> list[tuple[object, list[int]]]:
        """(kernel weight, sizes of the parts it computes) in part order."""
        return list(self._groups)

    def project(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        """The stacked outputs [T, sum(sizes)], parts side by side in the order given (one kernel
        weight only: GatedMLP's gate/up)."""
        if len(self._groups) != 1:
            raise ValueError("project() needs parts of one ggml type; call the module instead")
        x2 = x.reshape(-1, self.in_features)
        tails = self.lora.tails(x2) if self.lora is not None else None
        y = _matmul(self._groups[0][0], x2, xq, tails[0] if tails else None)
        y = y + self.bias if self.bias is not None else y
        return self.lora.add_stacked(x2, y) if self.lora is not None and not tails else y

    def forward(self, x: torch.Tensor, xq=None) -> tuple[torch.Tensor, ...]:
        """Each part's output [T, size] (views of the group outputs)."""
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        tri = [k for k, _ in self._groups if k.kind == "triton"]
        takes = bool(tri) and all(k.takes_quantized(rows) for k in tri)
        if xq is None and len(self._groups) > 1 and x2.is_cuda and takes:
            xq = _quantized_twin(x2)  # once for every group
        tails = self.lora.tails(x2) if self.lora is not None else None
        outs: list[torch.Tensor] = []
        for g, (kernel, sizes) in enumerate(self._groups):
            tail = tails[g] if tails else None
            outs.extend(_matmul(kernel, x2, xq, tail).split(sizes, dim=-1))
        if self.bias is not None:
            outs = [o + b for o, b in zip(outs, self.bias.split(self.sizes), strict=True)]
        if self.lora is not None and not tails:
            outs = self.lora.add_parts(x2, outs)
        return tuple(outs)


def _quantized_twin(x: torch.Tensor):
    """x's rows quantized for the dp4a GEMVs and int8 GEMMs (the caller checked that they take
    them), else None."""
    if x.dtype != torch.float32 or x.shape[1] % 32:
        return None
    from localllm.kernels.quant.triton_packed import quantize_x8

    return quantize_x8(x.contiguous())
