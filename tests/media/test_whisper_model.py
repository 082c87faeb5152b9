"""Our Whisper encoder/decoder against transformers' WhisperForConditionalGeneration on the same
random tiny weights (saved as safetensors, loaded by our HF loader)."""

import pytest
import torch

from localllm.media.stt.model import KVCache
from localllm.media.stt.weights import WhisperLoadError, load_model

transformers = pytest.importorskip("transformers")

# float32 on CPU: the two implementations differ only in op order (SDPA vs eager, fused GELU).
ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        vocab_size=400,
        num_mel_bins=80,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_source_positions=50,
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=2,
    )
    ref = transformers.WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random biases everywhere, so a dropped bias would show
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("tiny-whisper")
    ref.save_pretrained(path, safe_serialization=True)
    return ref, load_model(path)


def test_config_from_the_tensors(tiny):
    _, ours = tiny
    c = ours.config
    assert (c.n_mels, c.n_audio_ctx, c.n_audio_state, c.n_audio_layer) == (80, 50, 64, 2)
    assert (c.n_vocab, c.n_text_ctx, c.n_text_head, c.n_text_layer) == (400, 32, 4, 2)


def test_encoder_matches_transformers(tiny):
    ref, ours = tiny
    mel = torch.randn(2, 80, 100)
    with torch.no_grad():
        want = ref.model.encoder(mel).last_hidden_state
        got = ours.encoder(mel)
    assert want.std() > 0.1
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_decoder_logits_match_with_and_without_cache(tiny):
    ref, ours = tiny
    mel = torch.randn(2, 80, 100)
    tokens = torch.randint(3, 400, (2, 9))
    with torch.no_grad():
        want = ref(input_features=mel, decoder_input_ids=tokens).logits
        feats = ours.encoder(mel)
        whole = ours.decoder(tokens, ours.new_cache(feats))
        cache = ours.new_cache(feats)
        prefix = ours.decoder(tokens[:, :4], cache)
        steps = [ours.decoder(tokens[:, i : i + 1], cache) for i in range(4, 6)]
        rest = ours.decoder(tokens[:, 6:], cache)  # a multi-token step after a prefix
    assert want.std() > 0.1
    torch.testing.assert_close(whole, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([prefix, *steps, rest], 1), want, atol=ATOL, rtol=0)
    assert cache.length == 9


def test_reorder_repeats_cache_rows(tiny):
    _, ours = tiny
    with torch.no_grad():
        feats = ours.encoder(torch.randn(1, 80, 100))
        cache = ours.new_cache(feats)
        ours.decoder(torch.tensor([[5, 6]]), cache)
        ours.reorder(cache, torch.tensor([0, 0]))
        two = ours.decoder(torch.tensor([[7], [7]]), cache)
        single = ours.decoder(torch.tensor([[5, 6, 7]]), ours.new_cache(feats))[:, -1:]
    torch.testing.assert_close(two, single.expand(2, -1, -1), atol=ATOL, rtol=0)


def test_decoder_refuses_more_than_its_context(tiny):
    _, ours = tiny
    cache = ours.new_cache(ours.encoder(torch.randn(1, 80, 100)))
    with pytest.raises(ValueError, match="at most 32"):
        ours.decoder(torch.zeros(1, 33, dtype=torch.long), cache)


def test_load_errors(tmp_path):
    with pytest.raises(WhisperLoadError, match="no such Whisper model"):
        load_model(tmp_path / "nope")
    with pytest.raises(WhisperLoadError, match="not a Whisper directory"):
        load_model(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"\x06\x00\x00\x00\x14\x00Whisper")
    with pytest.raises(ValueError, match="truncated"):
        load_model(tmp_path)


def test_kvcache_starts_empty():
    assert KVCache(cross=[]).length == 0
