"""MusicGen's configuration as frozen dataclasses, read from a Hugging Face folder's config.json
(`text_encoder`, `audio_encoder` and `decoder` sub-configs) and preprocessor_config.json.

Covers `model_type` "musicgen" (text states reach the decoder by cross-attention) and
"musicgen_melody" (text states and a chroma of the melody are a prefix of the decoder's own
sequence). Every field the code uses is checked here, so a bad folder fails at load in one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("musicgen", "musicgen_melody")


class MusicModelError(ValueError):
    """The folder is not a MusicGen model we can load (the message names the file and field)."""


@dataclass(frozen=True)
class T5Args:
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    num_buckets: int
    max_distance: int
    eps: float
    gated: bool  # T5 v1.1's gated feed-forward (wi_0 * act, wi_1); t5-base has the plain one
    act: str  # "relu" or a gelu


@dataclass(frozen=True)
class DecoderArgs:
    vocab_size: int  # codes per codebook; the pad/BOS id is vocab_size
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    num_codebooks: int  # 4 mono, 8 stereo (left/right interleaved)
    audio_channels: int
    max_positions: int
    activation: str
    pad_token_id: int
    scale_embedding: bool


@dataclass(frozen=True)
class EncodecArgs:
    sampling_rate: int
    hidden_size: int
    num_filters: int
    num_residual_layers: int
    upsampling_ratios: tuple[int, ...]
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    causal: bool
    pad_mode: str
    compress: int
    num_lstm_layers: int
    trim_right_ratio: float
    codebook_size: int
    codebook_dim: int
    use_conv_shortcut: bool
    num_quantizers: int

    @property
    def hop_length(self) -> int:
        return math.prod(self.upsampling_ratios)

    @property
    def frame_rate(self) -> int:
        return math.ceil(self.sampling_rate / self.hop_length)


@dataclass(frozen=True)
class ChromaArgs:
    """MusicGen-Melody's chroma: the feature extractor's STFT and the model's prefix length."""

    sampling_rate: int
    n_fft: int
    hop_length: int
    max_seconds: float  # the extractor truncates the melody to this
    num_chroma: int
    chroma_length: int  # prefix frames: shorter chroma is tiled to this length


@dataclass(frozen=True)
class MusicGenConfig:
    kind: str
    text: T5Args
    decoder: DecoderArgs
    codec: EncodecArgs
    chroma: ChromaArgs | None  # melody models only

    @property
    def stereo(self) -> bool:
        return self.decoder.audio_channels == 2

    @property
    def sample_rate(self) -> int:
        return self.codec.sampling_rate

    @property
    def frame_rate(self) -> int:
        return self.codec.frame_rate

    @property
    def melody(self) -> bool:
        return self.kind == "musicgen_melody"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MusicModelError(f"{path}: missing (not a MusicGen folder)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MusicModelError(f"{path}: cannot read ({e})") from None
    if not isinstance(data, dict):
        raise MusicModelError(f"{path}: not a JSON object")
    return data


class _Fields:
    """Typed reads of one sub-config, each error naming the file and the key."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise MusicModelError(f"{where}: missing or not an object")
        self.data, self.where = data, where

    def int(self, key: str, default: int | None = None, low: int = 1) -> int:
        v = self.data.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise MusicModelError(f"{self.where}.{key}: expected an integer >= {low}, got {v!r}")
        return v

    def num(self, key: str, default: float | None = None) -> float:
        v = self.data.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise MusicModelError(f"{self.where}.{key}: expected a number, got {v!r}")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        v = self.data.get(key, default)
        if not isinstance(v, bool):
            raise MusicModelError(f"{self.where}.{key}: expected true or false, got {v!r}")
        return v

    def text(self, key: str, default: str, allowed: tuple[str, ...]) -> str:
        v = self.data.get(key, default)
        if v not in allowed:
            raise MusicModelError(f"{self.where}.{key}: {v!r} is not supported ({allowed})")
        return v


def _t5(f: _Fields) -> T5Args:
    proj = f.text("feed_forward_proj", "relu", ("relu", "gated-gelu", "gated-relu", "gelu"))
    gated = proj.startswith("gated-")
    act = proj.removeprefix("gated-")
    act = "gelu_new" if act == "gelu" else act  # T5 v1.1's gelu is the tanh approximation
    d_model, heads = f.int("d_model"), f.int("num_heads")
    return T5Args(
        vocab_size=f.int("vocab_size"), d_model=d_model, d_kv=f.int("d_kv", d_model // heads),
        d_ff=f.int("d_ff"), num_layers=f.int("num_layers"), num_heads=heads,
        num_buckets=f.int("relative_attention_num_buckets", 32),
        max_distance=f.int("relative_attention_max_distance", 128),
        eps=f.num("layer_norm_epsilon", 1e-6), gated=gated, act=act,
    )  # fmt: skip


def _decoder(f: _Fields) -> DecoderArgs:
    hidden, heads = f.int("hidden_size"), f.int("num_attention_heads")
    if hidden % heads:
        raise MusicModelError(f"{f.where}: hidden_size {hidden} is not a multiple of the heads")
    channels = f.int("audio_channels", 1)
    books = f.int("num_codebooks")
    if channels not in (1, 2) or books % channels:
        raise MusicModelError(f"{f.where}: {books} codebooks over {channels} channels")
    vocab = f.int("vocab_size")
    return DecoderArgs(
        vocab_size=vocab, hidden_size=hidden, num_layers=f.int("num_hidden_layers"),
        num_heads=heads, ffn_dim=f.int("ffn_dim"), num_codebooks=books, audio_channels=channels,
        max_positions=f.int("max_position_embeddings", 2048),
        activation=f.text("activation_function", "gelu", ("gelu", "relu", "gelu_new", "silu")),
        pad_token_id=f.int("pad_token_id", vocab, low=0),
        scale_embedding=f.flag("scale_embedding", False),
    )  # fmt: skip


def _encodec(f: _Fields) -> EncodecArgs:
    f.text("norm_type", "weight_norm", ("weight_norm",))
    if f.flag("normalize", False):
        raise MusicModelError(f"{f.where}.normalize: normalized EnCodec is not supported")
    if f.data.get("chunk_length_s") is not None:
        raise MusicModelError(f"{f.where}.chunk_length_s: chunked EnCodec is not supported")
    ratios = f.data.get("upsampling_ratios", [8, 5, 4, 2])
    if (
        not isinstance(ratios, list)
        or not ratios
        or not all(isinstance(r, int) and r > 0 for r in ratios)
    ):
        raise MusicModelError(f"{f.where}.upsampling_ratios: expected positive integers")
    hidden, size = f.int("hidden_size", 128), f.int("codebook_size", 1024)
    if size & (size - 1):
        raise MusicModelError(f"{f.where}.codebook_size: {size} is not a power of two")
    rate = f.int("sampling_rate", 24000)
    frame_rate = math.ceil(rate / math.prod(ratios))
    bandwidths = f.data.get("target_bandwidths") or [24.0]
    # what transformers derives: as many quantizers as the largest bandwidth pays for
    quantizers = int(1000 * float(bandwidths[-1]) // (frame_rate * math.ceil(math.log2(size))))
    return EncodecArgs(
        sampling_rate=rate, hidden_size=hidden, num_filters=f.int("num_filters", 32),
        num_residual_layers=f.int("num_residual_layers", 1), upsampling_ratios=tuple(ratios),
        kernel_size=f.int("kernel_size", 7), last_kernel_size=f.int("last_kernel_size", 7),
        residual_kernel_size=f.int("residual_kernel_size", 3),
        dilation_growth_rate=f.int("dilation_growth_rate", 2),
        causal=f.flag("use_causal_conv", True),
        pad_mode=f.text("pad_mode", "reflect", ("reflect", "constant", "replicate")),
        compress=f.int("compress", 2), num_lstm_layers=f.int("num_lstm_layers", 2),
        trim_right_ratio=f.num("trim_right_ratio", 1.0), codebook_size=size,
        codebook_dim=f.int("codebook_dim", hidden) if f.data.get("codebook_dim") else hidden,
        use_conv_shortcut=f.flag("use_conv_shortcut", True), num_quantizers=max(quantizers, 1),
    )  # fmt: skip


def _chroma(folder: Path, top: _Fields, sample_rate: int) -> ChromaArgs:
    pre_path = folder / "preprocessor_config.json"
    # the extractor's defaults when the folder has no preprocessor_config.json
    pre = _Fields(_read_json(pre_path) if pre_path.is_file() else {}, pre_path.name)
    return ChromaArgs(
        sampling_rate=pre.int("sampling_rate", sample_rate), n_fft=pre.int("n_fft", 16384),
        hop_length=pre.int("hop_length", 4096), max_seconds=pre.num("chunk_length", 30),
        num_chroma=top.int("num_chroma", 12), chroma_length=top.int("chroma_length", 235),
    )  # fmt: skip


def load_config(folder: str | Path) -> MusicGenConfig:
    """The configuration of the MusicGen folder `folder` (MusicModelError when it is not one)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MusicModelError(f"{folder}: not a model folder")
    data = _read_json(folder / "config.json")
    kind = data.get("model_type")
    if kind not in KINDS:
        raise MusicModelError(
            f"{folder / 'config.json'}: model_type {kind!r} is not a MusicGen model ({KINDS})"
        )
    top = _Fields(data, "config.json")
    text = _t5(_Fields(data.get("text_encoder"), "config.json text_encoder"))
    decoder = _decoder(_Fields(data.get("decoder"), "config.json decoder"))
    codec = _encodec(_Fields(data.get("audio_encoder"), "config.json audio_encoder"))
    if decoder.num_codebooks != codec.num_quantizers * decoder.audio_channels:
        raise MusicModelError(
            f"config.json: the decoder has {decoder.num_codebooks} codebooks, the EnCodec "
            f"{codec.num_quantizers} quantizers x {decoder.audio_channels} channels"
        )
    if decoder.vocab_size != codec.codebook_size:
        raise MusicModelError(
            f"config.json: decoder vocab_size {decoder.vocab_size} != EnCodec codebook_size "
            f"{codec.codebook_size}"
        )
    chroma = _chroma(folder, top, codec.sampling_rate) if kind == "musicgen_melody" else None
    return MusicGenConfig(kind, text, decoder, codec, chroma)
