"""whisper.cpp ggml `.bin` files: written here in whisper.cpp's layout (convert-pt-to-ggml.py's
names, shapes and types) from known weights, then read back by our loader."""

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.media.stt import load_whisper, transcribe
from localllm.media.stt.ggml import GGMLFormatError, read_ggml
from localllm.media.stt.weights import load_model

gguf_quants = pytest.importorskip("gguf.quants")

_OPENAI_NAMES = (  # ours -> openai-whisper's, applied in order
    ("encoder.positions", "encoder.positional_embedding"),
    ("decoder.positions", "decoder.positional_embedding"),
    ("decoder.embed.", "decoder.token_embedding."),
    ("layers.", "blocks."),
    ("cross_ln", "cross_attn_ln"),
    ("cross.", "cross_attn."),
    (".q.", ".query."),
    (".k.", ".key."),
    (".v.", ".value."),
    ("mlp.fc1.", "mlp.0."),
    ("mlp.fc2.", "mlp.2."),
)


def write_ggml(path: Path, model, vocab: list[bytes], q8_linears: bool = False) -> dict:
    """A ggml file as whisper.cpp's converter writes it; returns the Q8_0 bytes it wrote."""
    c = model.config
    hp = [c.n_vocab, c.n_audio_ctx, c.n_audio_state, c.n_audio_head, c.n_audio_layer,
          c.n_text_ctx, c.n_text_state, c.n_text_head, c.n_text_layer, c.n_mels, 1]  # fmt: skip
    quantized = {}
    with path.open("wb") as f:
        f.write(struct.pack("<I", 0x67676D6C) + struct.pack("<11i", *hp))
        f.write(struct.pack("<2i", c.n_mels, 201) + np.zeros(c.n_mels * 201, "<f4").tobytes())
        f.write(struct.pack("<i", len(vocab)))
        for tok in vocab:
            f.write(struct.pack("<I", len(tok)) + tok)
        for name, t in model.state_dict().items():
            for old, new in _OPENAI_NAMES:
                name = name.replace(old, new)
            data = t.detach().float().numpy()
            if name.endswith(("conv1.bias", "conv2.bias")):
                data = data.reshape(-1, 1)
            keep_f32 = data.ndim < 2 or "positional" in name or ("conv" in name and "bias" in name)
            is_linear = data.ndim == 2 and "embedding" not in name and data.shape[1] % 32 == 0
            if q8_linears and is_linear:
                raw, ttype = gguf_quants.quantize(data, gguf_quants.GGMLQuantizationType.Q8_0), 8
                quantized[name] = raw
            elif keep_f32:
                raw, ttype = data.astype("<f4"), 0
            else:
                raw, ttype = data.astype("<f2"), 1
            ne = list(reversed(data.shape))
            key = name.encode()
            f.write(struct.pack(f"<3i{len(ne)}i", len(ne), len(key), ttype, *ne) + key)
            f.write(raw.tobytes())
    return quantized


def test_f16_ggml_loads_the_same_model(whisper_tiny_en, tmp_path):
    ref = load_model(whisper_tiny_en)  # float16 weights in the file, so f16 ggml is lossless
    from localllm.media.stt.tokenizer import WhisperTokenizer

    tok = WhisperTokenizer.from_file(whisper_tiny_en / "tokenizer.json")
    vocab = [tok.tok.decode([i]).encode() for i in range(tok.special.eot)]
    path = tmp_path / "ggml-tiny.en.bin"
    write_ggml(path, ref, vocab)
    g = read_ggml(path)
    assert g.hparams["n_audio_state"] == 384 and g.hparams["n_text_layer"] == 4
    ours = load_model(path)
    assert ours.config == ref.config
    for (name, a), (_, b) in zip(ref.state_dict().items(), ours.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    bundle = load_whisper(path)  # the tokenizer comes from the packaged tiny.en, vocab-checked
    assert bundle.name == "ggml-tiny.en" and bundle.tokenizer.special.eot == 50256
    t = np.arange(16_000 * 2) / 16_000
    audio = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    want = transcribe(load_whisper(whisper_tiny_en), audio)
    assert transcribe(bundle, audio) == want


def test_q8_0_tensors_dequantize_like_gguf(whisper_tiny_en, tmp_path):
    ref = load_model(whisper_tiny_en)
    path = tmp_path / "ggml-tiny.en-q8_0.bin"
    written = write_ggml(path, ref, [b"x"] * 50256, q8_linears=True)
    g = read_ggml(path)
    assert len(written) == 4 * 6 + 4 * 10  # every linear of 4 encoder + 4 decoder layers: Q8_0
    for name, raw in list(written.items())[:6]:
        want = gguf_quants.dequantize(raw, gguf_quants.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(g.tensors[name].numpy(), want)
    ours = load_model(path)
    w, q = ref.encoder.layers[0].mlp.fc1.weight, ours.encoder.layers[0].mlp.fc1.weight
    assert not torch.equal(w, q) and (w - q).abs().max() < 0.01 * w.abs().max()


def test_bad_ggml_files(tmp_path):
    bad = tmp_path / "ggml-bad.bin"
    bad.write_bytes(struct.pack("<I", 0x67676D6C) + b"\x01\x00")
    with pytest.raises(GGMLFormatError, match="truncated"):
        read_ggml(bad)
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(GGMLFormatError, match="bad magic"):
        read_ggml(bad)
