"""Our Kokoro port against the reference `kokoro` package (KModel) on the same random weights:
a small-config KModel is saved in the released checkpoint layout (`module.` prefixes, weight
norm as weight_g/weight_v), loaded with our loader, and compared stage by stage.

Tolerances (float32, observed ~1e-6): PL-BERT, F0/energy curves and audio within 1e-4 of the
reference (audio peak ~1); durations are integers and must be equal. The decoder's noise is made
identical by seeding: ours draws from a seeded torch.Generator in the reference's order, the
reference from torch's global RNG seeded with the same number.
"""

import json
import sys
import types
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from localllm.media.tts.kokoro import KokoroFormatError, KokoroTTS, load_kokoro
from localllm.media.tts.kokoro.checkpoint import PARTS, normalize_state_dict
from localllm.media.tts.kokoro.phonemes import to_kokoro
from localllm.media.tts.phonemize import Sentence

TOL = 1e-4
# Kokoro v1.0's symbol set (facts of the format): ids are their order here, from 1.
SYMBOLS = (
    ';:,.!?—…"()“” \u0303ʣʥʦʨᵝꭧAIOQSTWYᵊabcdefhijklmnopqrstuvwxyzɑɐɒæβɔɕçɖðʤəɚɛɜɟɡɥɨɪʝɯɰŋɳɲɴ'
    "øɸθœɹɾɻʁɽʂʃʈʧʊʋʌɣɤχʎʒʔˈˌːʰʲ↓→↗↘ᵻ"
)
CONFIG = {
    "vocab": {c: i + 1 for i, c in enumerate(SYMBOLS)},
    "n_token": 178,
    "hidden_dim": 512,  # fixed by the architecture (the decoder's asr_res takes 512)
    "style_dim": 128,
    "n_layer": 2,
    "max_dur": 8,
    "dropout": 0.2,
    "text_encoder_kernel_size": 5,
    "n_mels": 80,
    "plbert": {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 160,
        "num_hidden_layers": 3,
        "embedding_size": 32,
        "dropout": 0.1,
    },
    "istftnet": {
        "upsample_kernel_sizes": [8, 4],
        "upsample_rates": [4, 2],
        "gen_istft_hop_size": 5,
        "gen_istft_n_fft": 20,
        "resblock_kernel_sizes": [3, 7],
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5]],
        "upsample_initial_channel": 512,
    },
}


def kmodel_class():
    """The reference KModel, imported without `kokoro/__init__` (which needs misaki's G2P)."""
    if find_spec("kokoro") is None or find_spec("loguru") is None:
        pytest.skip("reference `kokoro` package not installed (packaging/test-models.txt)")
    if "kokoro" not in sys.modules:
        pkg = types.ModuleType("kokoro")
        pkg.__path__ = list(find_spec("kokoro").submodule_search_locations)
        sys.modules["kokoro"] = pkg
    from loguru import logger

    logger.disable("kokoro")
    from kokoro.model import KModel

    return KModel


def build_reference(tmp_path_factory):
    """(reference KModel, its directory in the released layout)."""
    kmodel = kmodel_class()
    root = tmp_path_factory.mktemp("kokoro")
    torch.save({}, root / "empty.pth")
    torch.manual_seed(0)
    ref = kmodel(repo_id="test", config=CONFIG, model=str(root / "empty.pth")).eval()
    (root / "empty.pth").unlink()
    with torch.no_grad():
        # spread the durations (random weights give ~max_dur/2 everywhere) and lift F0 into
        # the voiced range, so rounding and the sine source are both exercised
        ref.bert_encoder.weight.mul_(20)
        for name, param in ref.predictor.named_parameters():
            if "weight_ih" in name:
                param.mul_(4)
        ref.predictor.duration_proj.linear_layer.weight.mul_(30)
        ref.predictor.F0_proj.bias.fill_(15.0)
        ref.predictor.F0_proj.weight.mul_(100)
    parts = {
        name: {f"module.{k}": v for k, v in getattr(ref, name).state_dict().items()}
        for name in PARTS
    }
    torch.save(parts, root / "kokoro-v1_0.pth")
    (root / "config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
    (root / "voices").mkdir()
    gen = torch.Generator().manual_seed(1)
    for name in ("af_test", "bm_test"):
        torch.save(torch.randn(510, 1, 256, generator=gen), root / "voices" / f"{name}.pt")
    return ref, root


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_reference(tmp_path_factory)


@pytest.fixture(scope="module")
def ref(built):
    return built[0]


@pytest.fixture(scope="module")
def tts(built) -> KokoroTTS:
    return load_kokoro(built[1])


IDS = torch.tensor([[0, 50, 83, 54, 156, 31, 16, 65, 156, 86, 123, 54, 46, 4, 0]])


def _style(seed: int = 2) -> torch.Tensor:
    return torch.randn(1, 256, generator=torch.Generator().manual_seed(seed))


def _reference_alignment(durations: torch.Tensor) -> torch.Tensor:
    aln = torch.zeros(durations.shape[0], int(durations.sum()))
    index = torch.repeat_interleave(torch.arange(durations.shape[0]), durations)
    aln[index, torch.arange(index.shape[0])] = 1
    return aln.unsqueeze(0)


def test_weight_norm_folded_to_reference_weights(ref, tts) -> None:
    ours = tts.model.decoder.generator.ups[0].weight
    g = ref.decoder.generator.ups[0].weight_g
    v = ref.decoder.generator.ups[0].weight_v
    torch.testing.assert_close(ours, torch._weight_norm(v, g, 0), atol=1e-6, rtol=1e-6)


def test_bert_matches_reference(ref, tts) -> None:
    with torch.no_grad():
        expected = ref.bert(IDS, attention_mask=torch.ones_like(IDS))
        got = tts.model.bert(IDS)
    assert (got - expected).abs().max() < TOL


@pytest.mark.parametrize("speed", [1.0, 1.6])
def test_durations_equal_reference(ref, tts, speed: float) -> None:
    s = _style()
    torch.manual_seed(0)
    _, expected = ref.forward_with_tokens(IDS, s, speed)
    got = tts.model.prosody(IDS, s, speed).durations
    assert len(set(expected.tolist())) > 2  # varied, so a rounding slip would show
    assert torch.equal(got, expected)


def test_f0_and_energy_curves_match_reference(ref, tts) -> None:
    s = _style()
    p = tts.model.prosody(IDS, s)
    with torch.no_grad():
        mask = torch.zeros_like(IDS, dtype=torch.bool)
        lengths = torch.tensor([IDS.shape[1]])
        d_en = ref.bert_encoder(ref.bert(IDS, attention_mask=torch.ones_like(IDS)))
        d = ref.predictor.text_encoder(d_en.transpose(-1, -2), s[:, 128:], lengths, mask)
        aln = _reference_alignment(p.durations)
        f0, n = ref.predictor.F0Ntrain(d.transpose(-1, -2) @ aln, s[:, 128:])
        asr = ref.text_encoder(IDS, lengths, mask) @ aln
    assert f0.shape == p.f0.shape == (1, 2 * int(p.durations.sum()))
    assert (f0 > 10).any() and (f0 <= 10).any()  # both voiced and unvoiced frames
    assert (p.f0 - f0).abs().max() < TOL * f0.abs().max()
    assert (p.n - n).abs().max() < TOL * max(1.0, float(n.abs().max()))
    assert (p.asr - asr).abs().max() < TOL


def test_decoder_audio_matches_reference_with_same_noise(ref, tts) -> None:
    s = _style()
    p = tts.model.prosody(IDS, s)
    with torch.no_grad():
        torch.manual_seed(7)
        expected = ref.decoder(p.asr, p.f0, p.n, s[:, :128]).reshape(-1)
    got = tts.model.decode(p, s, torch.Generator().manual_seed(7))
    other_noise = tts.model.decode(p, s, torch.Generator().manual_seed(8))
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < TOL * expected.abs().max()
    assert (other_noise - expected).abs().max() > 100 * TOL * expected.abs().max()


@pytest.fixture
def unvoiced(ref, tts):
    """Both models with F0 pushed below the voicing threshold for one test.

    Voiced audio integrates F0 into the sine phase, and this random decoder amplifies F0's
    float32 rounding (~1e-3 Hz) into ~10 % RMS differences; unvoiced, the path is exact. The
    voiced decoder is compared exactly above, on identical F0 input."""
    biases = (ref.predictor.F0_proj.bias, tts.model.predictor.F0_proj.bias)
    saved = [b.detach().clone() for b in biases]
    with torch.no_grad():
        for b in biases:
            b.fill_(-1000.0)
    yield
    with torch.no_grad():
        for b, old in zip(biases, saved, strict=True):
            b.copy_(old)


def _reference_speech(ref, tts, phonemes: str, seed: int) -> np.ndarray:
    pack = torch.load(tts.voice_files["af_test"], weights_only=True)
    torch.manual_seed(seed)
    out = ref(phonemes, pack[len(phonemes) - 1], return_output=True)
    return out.audio.clamp(-1, 1).numpy()


def test_text_to_audio_matches_reference_end_to_end(ref, tts, unvoiced) -> None:
    voice = tts.voice("af_test")
    [sentence] = voice.sentences("Hello world, this is a test.")
    assert sentence.text.startswith("həlˈO wˈɜɹld,")  # misaki-style symbols (O = oʊ, ɜɹ)
    expected = _reference_speech(ref, tts, sentence.text, 11)
    chunk = voice.render(sentence, generator=torch.Generator().manual_seed(11))
    assert chunk.sample_rate == 24_000 and chunk.samples.shape == expected.shape
    assert np.abs(chunk.samples - expected).max() < TOL


def test_voiced_text_to_audio_close_to_reference(ref, tts) -> None:
    voice = tts.voice("af_test")
    [sentence] = voice.sentences("Hello world, this is a test.")
    expected = _reference_speech(ref, tts, sentence.text, 11)

    def rel_rms(seed: int) -> float:
        got = voice.render(sentence, generator=torch.Generator().manual_seed(seed)).samples
        assert got.shape == expected.shape  # durations are exact
        return float(np.sqrt(np.mean((got - expected) ** 2) / np.mean(expected**2)))

    assert rel_rms(11) < 0.25 and rel_rms(12) > 0.8  # another seed is ~100 % off


def test_stream_yields_per_sentence_and_seed_reproduces(tts) -> None:
    voice = tts.voice("af_test")
    text = "The first sentence. And the second one!"
    chunks = list(voice.stream(text, seed=3))
    assert [c.phonemes for c in chunks] == [s.text for s in voice.sentences(text)]
    assert len(chunks) == 2
    first = voice.render(voice.sentences(text)[0], generator=torch.Generator().manual_seed(3))
    np.testing.assert_array_equal(chunks[0].samples, first.samples)
    again = voice.synthesize(text, seed=3)
    np.testing.assert_array_equal(again, np.concatenate([c.samples for c in chunks]))
    assert not np.array_equal(voice.synthesize(text, seed=4), again)


def test_british_voice_uses_british_phonemes(tts) -> None:
    assert tts.voice("bm_test").sentences("Go home.")[0].text == "ɡˌQ hˈQm."
    assert tts.voice("af_test").sentences("Go home.")[0].text == "ɡˌO hˈOm."


def test_espeak_to_kokoro_symbols() -> None:
    assert to_kokoro("a^ɪ ɛnd^ʒˈɔ^ɪ t^ʃˈɜːt^ʃ", "en-us") == "I ɛnʤˈY ʧˈɜɹʧ"
    assert to_kokoro("bˈʌʔn\u0329 bˈʌɾɚ", "en-us") == "bˈʌtn bˈʌTəɹ"
    assert to_kokoro("t^sa^ɪt", "de") == "ʦIt"


def test_empty_text_says_nothing_and_emoji_are_read_by_name(tts) -> None:
    voice = tts.voice()
    assert voice.name == "af_test"  # no af_heart here: the first voice is the default
    assert voice.sentences("") == [] and voice.sentences(" ?! ... ") == []
    assert voice.synthesize("").shape == (0,)
    # espeak names emoji (as for Piper voices); every symbol must be in Kokoro's vocabulary
    [sentence] = voice.sentences("🙂")
    assert set(sentence.phonemes) <= set(CONFIG["vocab"]) and len(sentence.phonemes) > 5


def test_unknown_voice_is_a_clear_error(tts) -> None:
    with pytest.raises(ValueError, match=r"unknown voice 'nope'.*af_test, bm_test"):
        tts.voice("nope")


def test_bad_speed_and_oversized_sentence(tts) -> None:
    voice = tts.voice("af_test")
    with pytest.raises(ValueError, match="speed"):
        list(voice.stream("Hi.", speed=0))
    with pytest.raises(ValueError, match="at most 158 phonemes"):
        voice.render(Sentence(tuple("a" * 159)))


def test_long_text_is_cut_to_the_context(tts) -> None:
    voice = tts.voice("af_test")
    sentences = voice.sentences("one two three four five six seven eight nine ten " * 8)
    assert len(sentences) > 1 and all(len(s.phonemes) <= 158 for s in sentences)


def test_checkpoint_with_missing_keys_is_a_clear_error(built, tmp_path) -> None:
    root = built[1]
    parts = torch.load(root / "kokoro-v1_0.pth", weights_only=True)
    del parts["decoder"]["module.encode.conv1.weight_g"]
    del parts["decoder"]["module.encode.conv1.weight_v"]
    for name in ("config.json", "voices"):
        (tmp_path / name).symlink_to(root / name)
    torch.save(parts, tmp_path / "kokoro-v1_0.pth")
    with pytest.raises(KokoroFormatError, match=r"'decoder'.*encode\.conv1\.weight"):
        load_kokoro(tmp_path)
    del parts["bert"]
    torch.save(parts, tmp_path / "kokoro-v1_0.pth")
    with pytest.raises(KokoroFormatError, match="lacks bert"):
        load_kokoro(tmp_path)


def test_bad_directory_config_and_voice_files(tts, tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        load_kokoro(tmp_path / "absent")
    (tmp_path / "config.json").write_text('{"vocab": {"a": 1}}', encoding="utf-8")
    (tmp_path / "kokoro-v1_0.pth").write_bytes(b"not a zip")
    with pytest.raises(KokoroFormatError, match="not a Kokoro config"):
        load_kokoro(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
    (tmp_path / "voices").mkdir()
    (tmp_path / "voices" / "af_x.pt").write_bytes(b"junk")
    with pytest.raises(KokoroFormatError, match="not a torch checkpoint"):
        load_kokoro(tmp_path)
    broken = KokoroTTS(tts.model, {"af_x": tmp_path / "voices" / "af_x.pt"}, "x")
    with pytest.raises(KokoroFormatError, match="not a voice file"):
        broken.voice("af_x")


def test_new_style_weight_norm_and_unprefixed_keys_fold_too() -> None:
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 6, 3))
    state = conv.state_dict()
    assert "parametrizations.weight.original0" in state
    folded = normalize_state_dict(state)
    assert set(folded) == {"weight", "bias"}
    torch.testing.assert_close(folded["weight"], conv.weight.detach(), atol=1e-6, rtol=1e-6)
    with pytest.raises(KokoroFormatError, match="has g but no v"):
        normalize_state_dict({"conv.weight_g": torch.ones(2, 1, 1)})
