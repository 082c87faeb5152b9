"""Load Whisper checkpoints into `model.Whisper`: CTranslate2 `model.bin` and HF safetensors dirs.

Each format is a name map onto the module tree of `model.py`; CTranslate2's fused QKV (and fused
cross-attention KV) are split, dropping the key bias it stores as zeros (softmax ignores a bias
that is the same for every key anyway). Shapes come from the tensors, head counts from the file.
"""

import json
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from localllm.media.stt.ct2 import read_ct2, view_bytes
from localllm.media.stt.model import Whisper, WhisperConfig

StateDict = dict[str, torch.Tensor]
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class WhisperLoadError(ValueError):
    """The directory is not a Whisper checkpoint in a format we read, or its tensors do not fit."""


def _count(names: list[str], prefix: str) -> int:
    layers = {n[len(prefix) :].split("/")[0].split(".")[0] for n in names if n.startswith(prefix)}
    return sum(1 for x in layers if x.isdigit())


def _config(sd: StateDict, audio_heads: int, text_heads: int) -> WhisperConfig:
    names = list(sd)
    return WhisperConfig(
        n_mels=sd["encoder.conv1.weight"].shape[1],
        n_audio_ctx=sd["encoder.positions"].shape[0],
        n_audio_state=sd["encoder.conv1.weight"].shape[0],
        n_audio_head=audio_heads,
        n_audio_layer=_count(names, "encoder.layers."),
        n_vocab=sd["decoder.embed.weight"].shape[0],
        n_text_ctx=sd["decoder.positions"].shape[0],
        n_text_state=sd["decoder.embed.weight"].shape[1],
        n_text_head=text_heads,
        n_text_layer=_count(names, "decoder.layers."),
    )


def _linear(sd: StateDict, dst: str, src: dict[str, torch.Tensor], base: str) -> None:
    sd[f"{dst}.weight"] = src[f"{base}/weight"]
    if f"{base}/bias" in src:
        sd[f"{dst}.bias"] = src[f"{base}/bias"]


def _norm(sd: StateDict, dst: str, src: dict[str, torch.Tensor], base: str) -> None:
    sd[f"{dst}.weight"], sd[f"{dst}.bias"] = src[f"{base}/gamma"], src[f"{base}/beta"]


def _split(sd: StateDict, dst: str, names: str, w: torch.Tensor, b: torch.Tensor) -> None:
    for name, wi, bi in zip(names, w.chunk(len(names)), b.chunk(len(names)), strict=True):
        sd[f"{dst}.{name}.weight"] = wi
        if name != "k":
            sd[f"{dst}.{name}.bias"] = bi


def ct2_state_dict(path: Path) -> tuple[StateDict, int, int]:
    """Our state dict from a CTranslate2 WhisperSpec, with the encoder and decoder head counts."""
    m = read_ct2(path)
    if m.spec != "WhisperSpec":
        raise WhisperLoadError(f"{path}: a CTranslate2 {m.spec}, not a WhisperSpec")
    t, sd = m.tensors, {}
    sd["encoder.conv1.weight"], sd["encoder.conv1.bias"] = (
        t["encoder/conv1/weight"],
        t["encoder/conv1/bias"],
    )
    sd["encoder.conv2.weight"], sd["encoder.conv2.bias"] = (
        t["encoder/conv2/weight"],
        t["encoder/conv2/bias"],
    )
    sd["encoder.positions"] = t["encoder/position_encodings/encodings"]
    _norm(sd, "encoder.ln_post", t, "encoder/layer_norm")
    sd["decoder.embed.weight"] = t["decoder/embeddings/weight"]
    sd["decoder.positions"] = t["decoder/position_encodings/encodings"]
    _norm(sd, "decoder.ln", t, "decoder/layer_norm")
    for side in ("encoder", "decoder"):
        for i in range(_count(list(t), f"{side}/layer_")):
            src, dst = f"{side}/layer_{i}", f"{side}.layers.{i}"
            sa = f"{src}/self_attention"
            _norm(sd, f"{dst}.attn_ln", t, f"{sa}/layer_norm")
            _split(sd, f"{dst}.attn", "qkv", t[f"{sa}/linear_0/weight"], t[f"{sa}/linear_0/bias"])
            _linear(sd, f"{dst}.attn.out", t, f"{sa}/linear_1")
            _norm(sd, f"{dst}.mlp_ln", t, f"{src}/ffn/layer_norm")
            _linear(sd, f"{dst}.mlp.fc1", t, f"{src}/ffn/linear_0")
            _linear(sd, f"{dst}.mlp.fc2", t, f"{src}/ffn/linear_1")
            if side == "decoder":
                ca = f"{src}/attention"
                _norm(sd, f"{dst}.cross_ln", t, f"{ca}/layer_norm")
                _linear(sd, f"{dst}.cross.q", t, f"{ca}/linear_0")
                _split(
                    sd, f"{dst}.cross", "kv", t[f"{ca}/linear_1/weight"], t[f"{ca}/linear_1/bias"]
                )
                _linear(sd, f"{dst}.cross.out", t, f"{ca}/linear_2")
    heads = int(t["encoder/num_heads"]), int(t["decoder/num_heads"])
    return sd, *heads


def read_safetensors(path: Path) -> StateDict:
    """Every tensor of one .safetensors file, as zero-copy views of a memory map."""
    with path.open("rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if len(mm) < 8:
        raise WhisperLoadError(f"{path}: too small for a safetensors file")
    (n,) = struct.unpack("<Q", mm[:8])
    if 8 + n > len(mm):
        raise WhisperLoadError(f"{path}: truncated safetensors header")
    header = json.loads(mm[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise WhisperLoadError(f"{path}: {name} has unsupported dtype {info['dtype']}")
        lo, hi = (8 + n + o for o in info["data_offsets"])
        if hi > len(mm):
            raise WhisperLoadError(f"{path}: {name} runs past the end of the file")
        out[name] = view_bytes(memoryview(mm)[lo:hi], _ST_DTYPES[info["dtype"]], info["shape"])
    return out


_HF_PARTS = (
    ("self_attn_layer_norm", "attn_ln"),
    ("encoder_attn_layer_norm", "cross_ln"),
    ("final_layer_norm", "mlp_ln"),
    ("self_attn.", "attn."),
    ("encoder_attn.", "cross."),
    ("_proj.", "."),
    ("fc1.", "mlp.fc1."),
    ("fc2.", "mlp.fc2."),
)
_HF_FIXED = {
    "encoder.embed_positions.weight": "encoder.positions",
    "encoder.layer_norm.weight": "encoder.ln_post.weight",
    "encoder.layer_norm.bias": "encoder.ln_post.bias",
    "decoder.embed_tokens.weight": "decoder.embed.weight",
    "decoder.embed_positions.weight": "decoder.positions",
    "decoder.layer_norm.weight": "decoder.ln.weight",
    "decoder.layer_norm.bias": "decoder.ln.bias",
}


def hf_state_dict(path: Path) -> tuple[StateDict, int, int]:
    """Our state dict from a transformers `openai/whisper-*` directory (config + safetensors)."""
    cfg = json.loads((path / "config.json").read_text())
    raw: StateDict = {}
    for file in sorted(path.glob("*.safetensors")):
        raw.update(read_safetensors(file))
    sd = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.")
        if name == "proj_out.weight":
            continue  # tied to the token embedding
        if name in _HF_FIXED:
            name = _HF_FIXED[name]
        elif ".layers." in name:
            for old, new in _HF_PARTS:
                name = name.replace(old, new)
        sd[name] = tensor
    return sd, cfg["encoder_attention_heads"], cfg["decoder_attention_heads"]


def ggml_file(path: Path) -> Path | None:
    """The whisper.cpp ggml file `path` is, or the one ggml*.bin inside directory `path`."""
    from localllm.media.stt.ggml import is_ggml

    if path.is_file():
        return path if is_ggml(path) else None
    found = [p for p in sorted(path.glob("ggml*.bin")) if is_ggml(p)]
    return found[0] if len(found) == 1 else None


def _detect(path: Path) -> Callable[[Path], tuple[StateDict, int, int]]:
    if ggml_file(path) is not None:
        from localllm.media.stt.ggml import ggml_state_dict

        return lambda p: ggml_state_dict(ggml_file(p))
    if path.is_dir() and (path / "model.bin").is_file():
        return ct2_state_dict
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return hf_state_dict
    raise WhisperLoadError(
        f"{path}: not a Whisper directory (expected a CTranslate2 model.bin, "
        "config.json + *.safetensors, or a whisper.cpp ggml .bin)"
    )


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Whisper:
    """Build and load the Whisper model at `path` (float32 on CPU unless `dtype`): a directory,
    or a whisper.cpp ggml file."""
    path = Path(path)
    if not path.is_dir() and not path.is_file():
        raise WhisperLoadError(f"{path}: no such Whisper model")
    try:
        sd, audio_heads, text_heads = _detect(path)(path)
        cfg = _config(sd, audio_heads, text_heads)
    except KeyError as e:
        raise WhisperLoadError(f"{path}: missing tensor {e.args[0]}") from None
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
    with torch.device("meta"):
        model = Whisper(cfg)
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise WhisperLoadError(f"{path}: tensors do not fit the model: {e}") from None
    return model.to(device=device, dtype=dtype).eval()
