"""MusicGen on CUDA (marked `gpu`): the decode step captured once as a CUDA graph and replayed
gives the codes of the same step run eagerly (bit for bit: the same kernels on the same inputs,
greedy and seeded sampling), and the codes of the eager cached step for greedy decoding; the
default on CUDA is the graph. Every recorded case of the tiny random-weight fixtures."""

import pytest
import torch

from localllm.media.music import MusicGen, SamplingOptions
from localllm.media.music.clip import load_clip
from localllm.media.music.steps import StaticSteps
from tests.media.music.music_fixture import CLIP_WAV, DATA, MELODY_WAV, expected

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CASES = sorted(expected()["cases"])
_MODELS: dict[str, MusicGen] = {}


def _model(name: str) -> MusicGen:
    if name not in _MODELS:
        _MODELS[name] = MusicGen(DATA / name, device="cuda")
    return _MODELS[name]


def _run(name: str, steps: str | None, greedy: bool):
    from localllm.media.audio import load_audio

    case = expected()["cases"][name]
    m = _model(case["model"])
    opts = SamplingOptions(
        temperature=0.0 if greedy else case.get("temperature", 1.0),
        top_k=case.get("top_k", 0) if not greedy else 0,
        guidance_scale=case["guidance_scale"],
        seed=case.get("seed", 0),
    )
    melody = load_audio(MELODY_WAV, m.sample_rate) if name.startswith("melody_cfg") else None
    frames, prompt = expected()["frames"], None
    if "prompt_frames" in case:
        prompt = m.encode(load_clip(CLIP_WAV, m.sample_rate, m.channels))
        frames += case["prompt_frames"]
    return m.codes(expected()["prompt"], frames, opts, melody, prompt, steps=steps).tolist()


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", CASES)
def test_graph_equals_the_same_step_eager(name, greedy):
    assert _run(name, "graph", greedy) == _run(name, "static", greedy)


@pytest.mark.parametrize("name", CASES)
def test_graph_greedy_equals_the_eager_cached_step(name):
    graph = _run(name, "graph", True)
    assert graph == _run(name, "cached", True)
    assert graph == _run(name, None, True)  # the default on CUDA


def test_cuda_default_is_the_captured_graph():
    m = _model("musicgen")
    cond = m._condition(m.tokenize("x"), None, SamplingOptions(), cached=True)
    step = m._steps(cond, 8, cached=True, kind=m.steps)
    assert isinstance(step, StaticSteps) and step.capture
