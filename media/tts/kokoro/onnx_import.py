"""Kokoro-82M from its int8 ONNX export (`kokoro-v1.0.int8.onnx`, onnxruntime dynamic
quantization): every weight dequantized back to float and keyed like the .pth checkpoint.

Where the weights are found:
- named initializers (`encoder.bert.*`, `decoder.decoder.*`, ...): the module path is the name;
  `X_quantized` with `X_scale` / a zero point is dequantized as (q - zero_point) * scale;
- anonymous ones (`onnx::MatMul_6547_quantized`, weight-normed conv weights folded into
  `/encoder/F0.0/Mul_output_0`): the module path is the consuming node's scope name;
- MatMul weights are stored [in, out] (transposed); DynamicQuantizeLSTM stores W [dirs, in, 4h]
  and R [dirs, h, 4h] with ONNX's gate order (i, o, f, c) against torch's (i, f, c, o).
The int8 weights make the audio close to, not equal to, the float model's.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from localllm.media.tts.kokoro.config import KokoroFormatError

_PREDICTOR_SCOPES = ("F0", "N", "F0_proj", "N_proj", "shared")
_TOP = ("bert", "bert_encoder", "predictor", "text_encoder")
# ONNX LSTM gate blocks (i, o, f, c) -> torch's (i, f, c, o)
_GATE_ORDER = (0, 2, 3, 1)


def _module_path(scope: str) -> str:
    """'/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant' -> 'text_encoder.cnn.0.0'."""
    parts: list[str] = []
    for comp in scope.strip("/").split("/")[:-1]:
        comp = re.sub(r"_\d+$", "", comp)  # repeated calls of a shared module: query_3
        if parts and comp.startswith(parts[-1] + "."):
            parts[-1] = comp  # nested Sequential scopes repeat the parent: cnn.0/cnn.0.0
        else:
            parts.append(comp)
    if parts[:2] == ["decoder", "decoder"]:
        return ".".join(["decoder", *parts[2:]])
    if parts and parts[0] == "encoder":
        rest = parts[1:]
        if rest and rest[0].split(".")[0] in _PREDICTOR_SCOPES:
            rest = ["predictor", *rest]
        return ".".join(rest)
    raise KokoroFormatError(f"unexpected ONNX scope {scope!r}")


def _param_name(name: str) -> str:
    """A named initializer -> its checkpoint key ('encoder.bert.x' -> 'bert.x')."""
    if name.startswith("decoder.decoder."):
        return "decoder." + name.removeprefix("decoder.decoder.")
    if name.startswith("encoder.") and name.split(".")[1] in _TOP:
        return name.removeprefix("encoder.")
    raise KokoroFormatError(f"unexpected ONNX initializer {name!r}")


class _Graph:
    def __init__(self, path: Path) -> None:
        import onnx
        from onnx import numpy_helper

        try:
            model = onnx.load(str(path))
        except Exception as exc:  # onnx raises DecodeError and others for a bad file
            raise KokoroFormatError(f"{path}: not an ONNX model ({exc})") from exc
        self.arrays = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        self.nodes = list(model.graph.node)
        self.by_name = {n.name: n for n in self.nodes}

    def dequant(self, name: str, zero_point: str | None = None) -> np.ndarray:
        """`X_quantized` -> float32, with `X_scale` and the given (or `X_zero_point`) zero point."""
        base = name.removesuffix("_quantized")
        q = self.arrays[name].astype(np.float32)
        zp = self.arrays[zero_point or f"{base}_zero_point"].astype(np.float32)
        return (q - zp) * self.arrays[f"{base}_scale"].astype(np.float32)

    def weight(self, name: str, zero_point: str | None = None) -> np.ndarray:
        return self.dequant(name, zero_point) if name.endswith("_quantized") else self.arrays[name]


def _lstm(g: _Graph, node, out: dict[str, torch.Tensor]) -> None:
    """DynamicQuantizeLSTM (X, W, R, B, ..., W_scale, W_zp, R_scale, R_zp) -> torch LSTM keys."""
    path = _module_path(node.name)
    w_q, r_q, b = node.input[1], node.input[2], node.input[3]
    w = (g.arrays[w_q].astype(np.float32) - g.arrays[node.input[9]][:, None, None]) * g.arrays[
        node.input[8]
    ][:, None, None]
    r = (g.arrays[r_q].astype(np.float32) - g.arrays[node.input[11]][:, None, None]) * g.arrays[
        node.input[10]
    ][:, None, None]
    bias = g.arrays[b]
    hidden = r.shape[1]

    def reorder(m: np.ndarray) -> np.ndarray:  # [..., 4h] in ONNX order -> torch order
        blocks = np.split(m, 4, axis=-1)
        return np.concatenate([blocks[i] for i in _GATE_ORDER], axis=-1)

    for d, suffix in enumerate(("", "_reverse")):
        out[f"{path}.weight_ih_l0{suffix}"] = torch.from_numpy(reorder(w[d]).T.copy())
        out[f"{path}.weight_hh_l0{suffix}"] = torch.from_numpy(reorder(r[d]).T.copy())
        out[f"{path}.bias_ih_l0{suffix}"] = torch.from_numpy(reorder(bias[d, : 4 * hidden]))
        out[f"{path}.bias_hh_l0{suffix}"] = torch.from_numpy(reorder(bias[d, 4 * hidden :]))


def read_kokoro_onnx(path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """The ONNX export's weights as the checkpoint's five float state dicts."""
    g = _Graph(Path(path))
    flat: dict[str, torch.Tensor] = {}
    for node in g.nodes:
        ins = list(node.input)
        if node.op_type in ("MatMulInteger", "MatMul") and len(ins) > 1 and ins[1] in g.arrays:
            zp = ins[3] if node.op_type == "MatMulInteger" else None
            key = f"{_module_path(node.name)}.weight"
            flat[key] = torch.from_numpy(np.array(g.weight(ins[1], zp).T))
        elif node.op_type in ("ConvInteger", "Conv", "ConvTranspose") and ins[1] in g.arrays:
            zp = ins[3] if node.op_type == "ConvInteger" else None
            path_ = _module_path(node.name)
            flat[f"{path_}.weight"] = torch.from_numpy(np.array(g.weight(ins[1], zp)))
        elif node.op_type == "DynamicQuantizeLSTM":
            _lstm(g, node, flat)
        elif node.op_type == "Gather" and ins[0].endswith("_quantized"):
            # embedding rows are dequantized after the lookup, by the node named after it
            deq = g.by_name[f"{node.name}_DequantizeLinear"]
            table = (g.arrays[ins[0]].astype(np.float32) - g.arrays[deq.input[2]]) * g.arrays[
                deq.input[1]
            ]
            flat[f"{_module_path(node.name)}.weight"] = torch.from_numpy(table)
    for name, value in g.arrays.items():
        if name.startswith(("encoder.", "decoder.decoder.")) and not name.endswith(
            ("_scale", "_zero_point", "_reshape_shape")
        ):
            key = _param_name(name.removesuffix("_quantized"))
            if not name.endswith("_quantized") and key not in flat:
                flat[key] = torch.from_numpy(np.array(value, dtype=np.float32))
    parts: dict[str, dict[str, torch.Tensor]] = {p: {} for p in (*_TOP, "decoder")}
    for key, value in flat.items():
        if ".stft." in key or ".istft." in key:
            continue  # the fixed inverse-STFT basis: our decoder calls torch.istft
        top, _, rest = key.partition(".")
        if top in parts:
            parts[top][rest] = value
    return parts
