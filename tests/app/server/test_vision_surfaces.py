"""Images through the Responses API (`input_image`) and Anthropic's Messages API (`image`
blocks, base64 and url) over a real socket, with the official `openai` and `anthropic` clients,
on `localllm serve --mmproj` with the Gemma 3 fixture (tests/data/vision/*gemma3*): each answer
equals the in-process engine's on the same image, and bad image parts get a clear 400."""

import base64
import http.server
import threading
from collections.abc import Iterator

import anthropic
import openai
import pytest

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.pipeline import VisionPipeline
from tests.app.server.conftest import Server, serve_process
from tests.media.test_vision_gemma3 import MMPROJ, TEXT, record
from tests.media.vision_fixture import image_bytes, run_greedy

N = 8
QUESTION = "What is in this image?"
GREEDY = {"temperature": 0}  # (this anthropic client has no temperature argument)
B64 = base64.b64encode(image_bytes("tall.png")).decode()


@pytest.fixture(scope="module")
def vserver(tmp_path_factory) -> Iterator[Server]:
    args = ["-m", str(TEXT), "--mmproj", str(MMPROJ), "--api-key", "k"]
    with serve_process(args, tmp_path_factory.mktemp("serve-gemma3-vision")) as (base, proc):
        yield Server(base, TEXT.stem, proc)


@pytest.fixture(scope="module")
def oai(vserver):
    return openai.OpenAI(base_url=vserver.base + "/v1", api_key="k", max_retries=0)


@pytest.fixture(scope="module")
def claude(vserver):
    return anthropic.Anthropic(base_url=vserver.base, api_key="k", max_retries=0)


@pytest.fixture(scope="module")
def expected() -> str:
    """The same question in-process: chat messages -> VisionPipeline -> LLMEngine."""
    engine = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    vision = VisionPipeline(MMPROJ, engine)
    try:
        msgs = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": QUESTION}]}]  # fmt: skip
        ids, mm = vision.chat(engine, msgs, [vision.prepare(image_bytes("tall.png"))])
        assert ids == record()["chats"]["one_image"]["input_ids"]
        _, out = run_greedy(engine, ids, mm, N)
        assert out.outputs[0].text
        return out.outputs[0].text
    finally:
        vision.close()
        engine.close()


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = image_bytes("tall.png")
        self.send_response(200 if self.path == "/tall.png" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _input(image: dict) -> list[dict]:
    return [{"role": "user", "content": [image, {"type": "input_text", "text": QUESTION}]}]


def test_responses_input_image_data_url(oai, vserver, expected):
    part = {"type": "input_image", "image_url": f"data:image/png;base64,{B64}"}
    r = oai.responses.create(model=vserver.model_id, input=_input(part), temperature=0,
                             max_output_tokens=N)  # fmt: skip
    assert r.output_text == expected
    assert r.usage.input_tokens == len(record()["chats"]["one_image"]["input_ids"])


def test_responses_input_image_http_url_streamed(oai, vserver, image_host, expected):
    part = {"type": "input_image", "image_url": image_host + "/tall.png", "detail": "auto"}
    stream = oai.responses.create(model=vserver.model_id, input=_input(part), temperature=0,
                                  max_output_tokens=N, stream=True)  # fmt: skip
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == expected


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ({"type": "input_image", "file_id": "file-1"}, "file_id is not supported"),
        ({"type": "input_image"}, "needs image_url"),
        ({"type": "input_file", "file_data": "x"}, "'input_file' are not supported"),
        ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "not an image"),
    ],
)
def test_responses_bad_image_parts_are_400(oai, vserver, part, says):
    with pytest.raises(openai.BadRequestError, match=says):
        oai.responses.create(model=vserver.model_id, input=_input(part), max_output_tokens=2)


def _ask(claude, model, block, **kw):
    content = [block, {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": content}]
    return claude.messages.create(
        model=model, max_tokens=N, extra_body=GREEDY, messages=messages, **kw
    )


def test_anthropic_base64_image(claude, vserver, expected):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    r = _ask(claude, vserver.model_id, block)
    assert r.content[0].text == expected
    prompt = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)  # (Anthropic's split)
    assert prompt == len(record()["chats"]["one_image"]["input_ids"])


def test_anthropic_url_image_streamed(claude, vserver, image_host, expected):
    block = {"type": "image", "source": {"type": "url", "url": image_host + "/tall.png"}}
    content = [block, {"type": "text", "text": QUESTION}]
    with claude.messages.stream(model=vserver.model_id, max_tokens=N, extra_body=GREEDY,
                                messages=[{"role": "user", "content": content}]) as s:  # fmt: skip
        text = "".join(s.text_stream)
    assert text == expected


def test_anthropic_count_tokens_with_an_image(claude, vserver):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    r = claude.messages.count_tokens(
        model=vserver.model_id,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}],
    )
    assert r.input_tokens == len(record()["chats"]["one_image"]["input_ids"])


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"type": "base64", "media_type": "image/svg+xml", "data": B64}, "media_type must be"),
        ({"type": "base64", "media_type": "image/png"}, "source.data must be"),
        ({"type": "file", "file_id": "f"}, "source.type must be 'base64' or 'url'"),
        ({"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}, "not an image"),
    ],
)
def test_anthropic_bad_image_blocks_are_400(claude, vserver, source, says):
    with pytest.raises(anthropic.BadRequestError, match=says):
        _ask(claude, vserver.model_id, {"type": "image", "source": source})


def test_anthropic_image_in_an_assistant_turn_is_400(claude, vserver):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": QUESTION},
    ]
    with pytest.raises(anthropic.BadRequestError, match="'image' are not supported"):
        claude.messages.create(model=vserver.model_id, max_tokens=2, messages=messages)
