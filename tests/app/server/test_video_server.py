"""Video over a real socket: `localllm serve --mmproj` (Qwen2.5-VL fixture) takes vLLM's
`video_url` parts from the official `openai` client; the answer equals the in-process
engine's; too many videos, a corrupt video and a video for a projector without video are 400s."""

import base64
from collections.abc import Iterator

import openai
import pytest

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.pipeline import VisionPipeline
from tests.app.server.conftest import Server, serve_process
from tests.media.test_vision_qwen25vl import DATA, MMPROJ, TEXT
from tests.media.vision_fixture import run_greedy

N = 6
QUESTION = "What happens in the video?"


def video_part(data: bytes) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def ask(client, model, *parts, **kw):
    content = [*parts, {"type": "text", "text": QUESTION}]
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kw
    )


@pytest.fixture(scope="module")
def vserver(tmp_path_factory) -> Iterator[Server]:
    args = ["-m", str(TEXT), "--mmproj", str(MMPROJ), "--limit-mm-per-prompt", "image=2,video=1"]
    with serve_process(args, tmp_path_factory.mktemp("serve-video")) as (base, proc):
        yield Server(base, TEXT.stem, proc)


@pytest.fixture(scope="module")
def client(vserver):
    return openai.OpenAI(base_url=vserver.base + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def expected() -> tuple[str, int]:
    """The same request in-process: (answer text, prompt tokens)."""
    engine = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    vision = VisionPipeline(MMPROJ, engine)
    try:
        msgs = [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}
        ]
        video = vision.prepare_video((DATA / "clip.mp4").read_bytes())
        ids, mm = vision.chat(engine, msgs, [video])
        _, out = run_greedy(engine, ids, mm, N)
        return out.outputs[0].text, len(ids)
    finally:
        vision.close()
        engine.close()


def test_models_lists_vision_and_video(client):
    (card,) = client.models.list().data
    assert {"vision", "video"} <= set(card.model_extra["capabilities"])


def test_a_data_url_video_gets_the_in_process_answer(client, vserver, expected):
    r = ask(client, vserver.model_id, video_part((DATA / "clip.mp4").read_bytes()),
            temperature=0, max_tokens=N)  # fmt: skip
    assert r.choices[0].message.content == expected[0]
    assert r.usage.prompt_tokens == expected[1]


def test_too_many_videos_is_a_400(client, vserver):
    clip = video_part((DATA / "clip.mp4").read_bytes())
    with pytest.raises(openai.BadRequestError, match=r"2 videos in one request.*video=M"):
        ask(client, vserver.model_id, clip, clip, max_tokens=2)


def test_a_corrupt_video_is_a_400(client, vserver):
    with pytest.raises(openai.BadRequestError, match="video"):
        ask(client, vserver.model_id, video_part(b"\x00\x00\x00\x18ftypmp42 broken"), max_tokens=2)


def test_a_video_to_a_projector_without_video_is_a_400(tmp_path):
    text = DATA / "llava-text.gguf"  # LLaVA-1.5: images only
    args = ["-m", str(text), "--mmproj", str(DATA / "mmproj-llava.gguf")]
    with serve_process(args, tmp_path) as (base, _):
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        (card,) = c.models.list().data
        assert "vision" in card.model_extra["capabilities"]
        assert "video" not in card.model_extra["capabilities"]
        with pytest.raises(openai.BadRequestError, match="does not take video"):
            ask(c, text.stem, video_part((DATA / "clip.mp4").read_bytes()), max_tokens=2)
