"""Read a Piper voice's ONNX file into named torch tensors and convolution specs.

Piper exports keep most VITS parameter names, but weight-norm convolutions are folded into
anonymous `onnx::Conv_*` initializers and some constants are folded into others. Every
Conv/ConvTranspose node is named after its module (`/flow/flows.6/enc/in_layers.0/Conv`), so
walking the graph maps each weight to its module together with its stride, padding, dilation
and groups, taken from the node rather than assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


class VoiceFormatError(ValueError):
    """The ONNX file is not a Piper VITS voice we can load."""


@dataclass(frozen=True)
class ConvSpec:
    """One (transposed) 1-d convolution: weight, optional bias and its node attributes."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: int
    padding: int
    dilation: int
    groups: int
    transposed: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            return torch.nn.functional.conv_transpose1d(
                x, self.weight, self.bias, self.stride, self.padding, 0, self.groups, self.dilation
            )
        return torch.nn.functional.conv1d(
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )


@dataclass(frozen=True)
class PiperWeights:
    """Named parameters (embeddings, norms, relative embeddings, affine flow) and convolutions."""

    tensors: dict[str, torch.Tensor]
    convs: dict[str, ConvSpec]

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise VoiceFormatError(f"voice has no parameter {name}") from None

    def conv(self, name: str) -> ConvSpec:
        try:
            return self.convs[name]
        except KeyError:
            raise VoiceFormatError(f"voice has no convolution {name}") from None


def _attrs(node: object) -> dict[str, object]:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}  # type: ignore[attr-defined]


def _one(values: object, default: int) -> int:
    if isinstance(values, list | tuple):
        if not values:
            return default
        if len(set(values)) != 1:
            raise VoiceFormatError(f"asymmetric convolution attribute {values}")
        return int(values[0])
    return int(values) if values is not None else default


def _module_name(node_name: str) -> str:
    # "/dec/resblocks.0/convs.1/Conv" -> "dec.resblocks.0.convs.1"
    return ".".join(node_name.strip("/").split("/")[:-1])


def read_piper_onnx(path: str | Path) -> PiperWeights:
    """Load the initializers of a Piper .onnx file as float32 torch tensors, keyed by VITS name."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise VoiceFormatError("loading Piper voices needs the `onnx` package") from exc
    try:
        model = onnx.load(str(path))
    except Exception as exc:
        raise VoiceFormatError(f"{path}: not a readable ONNX file ({exc})") from exc
    graph = model.graph
    raw = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in graph.initializer}
    tensors: dict[str, torch.Tensor] = {k: v.float() for k, v in raw.items() if "." in k}
    convs: dict[str, ConvSpec] = {}
    for node in graph.node:
        if node.op_type in ("Conv", "ConvTranspose"):
            name = _module_name(node.name)
            if node.input[1] not in raw:
                raise VoiceFormatError(f"{node.name}: weight {node.input[1]} is not an initializer")
            bias = raw.get(node.input[2]) if len(node.input) > 2 else None
            a = _attrs(node)
            convs[name] = ConvSpec(
                weight=raw[node.input[1]].float(),
                bias=None if bias is None else bias.float(),
                stride=_one(a.get("strides"), 1),
                padding=_one(a.get("pads"), 0),
                dilation=_one(a.get("dilations"), 1),
                groups=_one(a.get("group"), 1),
                transposed=node.op_type == "ConvTranspose",
            )
        elif node.op_type == "Gather" and node.name == "/enc_p/emb/Gather":
            # the symbol embedding is exported under the unused input's name ("sid")
            tensors["enc_p.emb.weight"] = raw[node.input[0]].float()
        elif node.op_type == "Mul" and node.name == "/dp/flows.0/Mul":
            # ElementwiseAffine in reverse multiplies by exp(-logs), folded to a constant
            tensors["dp.flows.0.exp_neg_logs"] = raw[node.input[1]].float()
    if "enc_p.emb.weight" not in tensors or not convs:
        raise VoiceFormatError(
            f"{path}: not a Piper VITS voice (no text embedding or convolutions)"
        )
    return PiperWeights(tensors, convs)
