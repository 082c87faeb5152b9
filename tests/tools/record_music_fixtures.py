"""Record the MusicGen fixtures of `tests/media/music/`: tiny random-weight MusicGen (mono and
stereo) and MusicGen-Melody folders made with transformers, two input clips, and transformers'
own results on them (`expected.json`, `expected_audio.npz`).

    PYTHONPATH=/tmp/ta python tests/tools/record_music_fixtures.py [--out tests/data/music]

Never imports localllm. transformers' MusicgenMelodyFeatureExtractor needs torchaudio for its
STFT (`transforms.Spectrogram`, plain torch): the PyPI torchaudio wheel is a CUDA build, so it is
installed with `pip install --no-deps --target /tmp/ta torchaudio` and its compiled libraries
removed (`rm /tmp/ta/torchaudio/lib/*.so`; torchaudio then runs without its extension).
Everything runs in float32 on one CPU thread with fixed seeds.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

SEED = 20240611
RATE = 32000
PROMPT = "80s pop track with bassy drums and synth"
CORPUS = [
    PROMPT,
    "lo-fi hip hop beat with warm piano chords and vinyl crackle",
    "epic orchestral score with strings brass and choir",
    "a calm acoustic guitar melody by the sea at sunset",
    "fast techno with a heavy kick and a rolling bassline",
    "jazz trio: upright bass, brushed drums, soft piano",
]
FRAMES = 10  # generated frames (0.2 s at EnCodec's 50 Hz)
CLIP_SECONDS = 0.1  # the clip to continue: 5 frames


_TOKENIZER = []  # trained once: Unigram training is not deterministic across runs


def tokenizer(out: Path) -> None:
    """A small T5-like Unigram tokenizer (Metaspace, `</s>` appended) saved beside the model."""
    if _TOKENIZER:
        _TOKENIZER[0].save_pretrained(out)
        return
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("  ", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=120, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    _TOKENIZER.append(fast)
    fast.save_pretrained(out)


def randomize(model: torch.nn.Module) -> None:
    """Every float parameter and buffer drawn anew (transformers zeroes the codebooks), norms
    near 1, so greedy choices are far from ties."""
    g = torch.Generator().manual_seed(SEED)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if "codebook.embed" in n})
    for name, t in tensors.items():
        if not t.dtype.is_floating_point or "embed_avg" in name:
            continue
        noise = torch.randn(t.shape, generator=g)
        with torch.no_grad():
            if "norm" in name and t.dim() == 1:
                t.copy_(1 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            elif "codebook.embed" in name:
                t.copy_(noise)
            else:
                fan_in = t.shape[-1] if t.dim() > 1 else 1
                t.copy_(noise * (2.5 / math.sqrt(fan_in)) if t.dim() > 1 else 0.1 * noise)


def configs(melody: bool, channels: int):
    from transformers import EncodecConfig, T5Config

    t5 = T5Config(vocab_size=128, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=16)  # fmt: skip
    codec = EncodecConfig(
        sampling_rate=RATE, num_filters=1, hidden_size=8, upsampling_ratios=[8, 5, 4, 4],
        codebook_size=64, target_bandwidths=[1.2], use_causal_conv=False, compress=1,
        use_conv_shortcut=False, num_lstm_layers=2,
    )  # fmt: skip
    dec = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
               ffn_dim=32, num_codebooks=4 * channels, audio_channels=channels,
               pad_token_id=64, bos_token_id=64, max_position_embeddings=256)  # fmt: skip
    if melody:
        from transformers import MusicgenMelodyConfig, MusicgenMelodyDecoderConfig

        return MusicgenMelodyConfig(
            text_encoder=t5, audio_encoder=codec, decoder=MusicgenMelodyDecoderConfig(**dec),
            num_chroma=12, chroma_length=20,
        )  # fmt: skip
    from transformers import MusicgenConfig, MusicgenDecoderConfig

    return MusicgenConfig(
        text_encoder=t5, audio_encoder=codec, decoder=MusicgenDecoderConfig(**dec)
    )


def build(out: Path, melody: bool, channels: int):
    from transformers import (
        EncodecFeatureExtractor,
        MusicgenForConditionalGeneration,
        MusicgenMelodyFeatureExtractor,
        MusicgenMelodyForConditionalGeneration,
    )

    torch.manual_seed(SEED)
    cls = MusicgenMelodyForConditionalGeneration if melody else MusicgenForConditionalGeneration
    model = cls(configs(melody, channels)).eval()
    randomize(model)
    # stored as float16 (small files; the loader's cast is exercised), and transformers then
    # runs on exactly those values in float32
    model.half().save_pretrained(out)
    model.float()
    tokenizer(out)
    if melody:
        MusicgenMelodyFeatureExtractor(n_fft=2048, hop_length=512).save_pretrained(out)
    else:
        EncodecFeatureExtractor(feature_size=channels, sampling_rate=RATE).save_pretrained(out)
    return model


def record_codes(model):
    """Wrap the codec's decode so the codes transformers generates are kept ((K, frames),
    stereo rows interleaved as the decoder has them)."""
    seen = []
    decode = model.audio_encoder.decode

    def wrapped(codes, *a, **kw):
        seen.append(codes[0, 0].clone())
        return decode(codes, *a, **kw)

    model.audio_encoder.decode = wrapped

    def codes():
        if len(seen) == 1:
            return seen[0]
        return torch.stack(seen, dim=1).reshape(-1, seen[0].shape[-1])  # L, R interleaved

    return seen, codes


def run(model, ids, books_per_channel, frames, prompt_frames=0, **kw):
    _, codes = record_codes(model)
    new = frames + books_per_channel - 1 - prompt_frames
    with torch.no_grad():
        audio = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=new, **kw)  # fmt: skip
    model.audio_encoder.decode = type(model.audio_encoder).decode.__get__(model.audio_encoder)
    return codes(), audio[0].float().numpy()


def clips(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """melody.wav: 0.6 s of a few tones (mono); clip.wav: 0.1 s of stereo noisy tones."""
    t = np.arange(int(0.6 * RATE)) / RATE
    notes = np.array([261.63, 329.63, 392.0, 523.25])[(t * 8).astype(int) % 4]
    melody = (0.5 * np.sin(2 * np.pi * notes * t)).astype(np.float32)
    sf.write(out / "melody.wav", melody, RATE, subtype="PCM_16")
    rng = np.random.default_rng(SEED)
    tc = np.arange(int(CLIP_SECONDS * RATE)) / RATE
    left = 0.4 * np.sin(2 * np.pi * 220 * tc) + 0.05 * rng.standard_normal(len(tc))
    right = 0.4 * np.sin(2 * np.pi * 330 * tc) + 0.05 * rng.standard_normal(len(tc))
    sf.write(out / "clip.wav", np.stack([left, right], 1).astype(np.float32), RATE,
             subtype="PCM_16")  # fmt: skip
    # what the files hold, as float32 (PCM_16 rounding included)
    melody_read = sf.read(out / "melody.wav", dtype="float32")[0]
    return melody_read, sf.read(out / "clip.wav", dtype="float32")[0]


def main() -> None:
    from transformers import AutoTokenizer, MusicgenMelodyFeatureExtractor

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/data/music", type=Path)
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    melody_audio, clip_audio = clips(out)
    expected: dict = {"prompt": PROMPT, "frames": FRAMES, "seed": SEED, "cases": {}}
    audio: dict[str, np.ndarray] = {}

    def case(name, model_dir, codes, wave, **info):
        expected["cases"][name] = {"model": model_dir, "codes": codes.tolist(), **info}
        if wave is not None:
            audio[name] = wave

    mono = build(out / "musicgen", melody=False, channels=1)
    ids = AutoTokenizer.from_pretrained(out / "musicgen")(PROMPT, return_tensors="pt").input_ids
    expected["ids"] = ids[0].tolist()
    c, w = run(mono, ids, 4, FRAMES, do_sample=False, guidance_scale=3.0)
    case("greedy_cfg3", "musicgen", c, w, guidance_scale=3.0)
    c, w = run(mono, ids, 4, FRAMES, do_sample=False, guidance_scale=1.0)
    case("greedy_cfg1", "musicgen", c, None, guidance_scale=1.0)
    torch.manual_seed(1234)
    sampling = dict(temperature=0.8, top_k=20, top_p=0.9, guidance_scale=3.0)
    c, _ = run(mono, ids, 4, FRAMES, do_sample=True, **sampling)
    case("sampled_seed1234", "musicgen", c, None, seed=1234, **sampling)
    # continuation: the clip averaged to mono, as load_audio does
    clip_mono = clip_audio.mean(axis=1, dtype=np.float32)
    clip_frames = math.ceil(len(clip_mono) / 640)
    values = torch.from_numpy(clip_mono)[None, None]
    c, w = run(mono, ids, 4, FRAMES + clip_frames, clip_frames, do_sample=False,
               guidance_scale=3.0, input_values=values)  # fmt: skip
    case("continue_cfg3", "musicgen", c, None, guidance_scale=3.0, prompt_frames=clip_frames)
    with torch.no_grad():
        enc = mono.audio_encoder.encode(values).audio_codes[0, 0]
    expected["clip_codes"] = enc.tolist()

    stereo = build(out / "musicgen-stereo", melody=False, channels=2)
    c, w = run(stereo, ids, 4, FRAMES, do_sample=False, guidance_scale=3.0)
    case("stereo_cfg3", "musicgen-stereo", c, w, guidance_scale=3.0)
    values = torch.from_numpy(np.ascontiguousarray(clip_audio.T))[None]
    c, w = run(stereo, ids, 4, FRAMES + clip_frames, clip_frames, do_sample=False,
               guidance_scale=3.0, input_values=values)  # fmt: skip
    case("stereo_continue_cfg3", "musicgen-stereo", c, None, guidance_scale=3.0,
         prompt_frames=clip_frames)  # fmt: skip

    mel = build(out / "musicgen-melody", melody=True, channels=1)
    fe = MusicgenMelodyFeatureExtractor.from_pretrained(out / "musicgen-melody")
    feats = fe(melody_audio, sampling_rate=RATE, return_tensors="pt").input_features
    expected["chroma"] = feats[0].argmax(-1).tolist()
    c, w = run(mel, ids, 4, FRAMES, do_sample=False, guidance_scale=3.0, input_features=feats)
    case("melody_cfg3", "musicgen-melody", c, w, guidance_scale=3.0)
    c, _ = run(mel, ids, 4, FRAMES, do_sample=False, guidance_scale=1.0, input_features=feats)
    case("melody_cfg1", "musicgen-melody", c, None, guidance_scale=1.0)
    c, _ = run(mel, ids, 4, FRAMES, do_sample=False, guidance_scale=3.0)
    case("melody_none_cfg3", "musicgen-melody", c, None, guidance_scale=3.0)

    import transformers

    expected["recorder"] = {"transformers": transformers.__version__,
                            "torch": torch.__version__, "threads": 1}  # fmt: skip
    (out / "expected.json").write_text(json.dumps(expected, indent=None) + "\n")
    np.savez_compressed(out / "expected_audio.npz", **audio)
    print({k: v["codes"][0][:10] for k, v in expected["cases"].items()})


if __name__ == "__main__":
    main()
