"""Images over a real socket: `localllm serve --mmproj` with the official `openai` client, the
answer equal to the in-process engine's, and a clear 400 for every bad image input."""

import base64
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import openai
import pytest

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.pipeline import VisionPipeline
from tests.app.server.conftest import Server, serve_process
from tests.media.test_vision_inputs import png_header
from tests.media.vision_fixture import MMPROJ, TEXT, image_bytes, record, run_greedy

N = 8
QUESTION = "What is in this image?"


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(client, model, *parts, **kw):
    content = [*parts, {"type": "text", "text": QUESTION}]
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kw
    )


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "tall.png").write_bytes(image_bytes("tall.png"))
    return d


@pytest.fixture(scope="module")
def vserver(media_dir, tmp_path_factory) -> Iterator[Server]:
    args = ["-m", str(TEXT), "--mmproj", str(MMPROJ), "--allowed-local-media-path",
            str(media_dir), "--limit-mm-per-prompt", "image=2", "--api-key", "k"]  # fmt: skip
    with serve_process(args, tmp_path_factory.mktemp("serve-vision")) as (base, proc):
        yield Server(base, TEXT.stem, proc)


@pytest.fixture(scope="module")
def client(vserver):
    return openai.OpenAI(base_url=vserver.base + "/v1", api_key="k", max_retries=0)


@pytest.fixture(scope="module")
def expected() -> str:
    """The same request in-process: chat messages -> VisionPipeline -> LLMEngine."""
    engine = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    vision = VisionPipeline(MMPROJ, engine)
    try:
        msgs = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
        ]
        ids, mm = vision.chat(engine, msgs, [vision.prepare(image_bytes("tall.png"))])
        assert ids == record()["chats"]["one_image"]["input_ids"]
        _, out = run_greedy(engine, ids, mm, N)
        return out.outputs[0].text
    finally:
        vision.close()
        engine.close()


def test_models_lists_vision(client):
    (card,) = client.models.list().data
    assert "vision" in card.model_extra["capabilities"]


def test_a_data_url_image_gets_the_in_process_answer(client, vserver, expected):
    r = ask(client, vserver.model_id, image_part(data_url(image_bytes("tall.png"))),
            temperature=0, max_tokens=N)  # fmt: skip
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(record()["chats"]["one_image"]["input_ids"])


def test_streamed_answer_is_the_same(client, vserver, expected):
    stream = ask(client, vserver.model_id, image_part(data_url(image_bytes("tall.png"))),
                 temperature=0, max_tokens=N, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_a_file_url_under_the_allowed_folder(client, vserver, media_dir, expected):
    r = ask(client, vserver.model_id, image_part((media_dir / "tall.png").as_uri()),
            temperature=0, max_tokens=N)  # fmt: skip
    assert r.choices[0].message.content == expected


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/tall.png":
            body = image_bytes("tall.png")
        else:  # "/huge": says 21 MiB; the server must refuse it from the header
            self.send_response(200)
            self.send_header("Content-Length", str(21 << 20))
            self.end_headers()
            self.wfile.write(b"\0" * 1024)
            return
        self.send_response(200)
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


def test_an_http_url_is_fetched(client, vserver, image_host, expected):
    r = ask(client, vserver.model_id, image_part(image_host + "/tall.png"),
            temperature=0, max_tokens=N)  # fmt: skip
    assert r.choices[0].message.content == expected


BAD = {
    "corrupt": (image_part(data_url(b"this is no picture")), "not an image in a supported"),
    "truncated": (image_part(data_url(image_bytes("tall.png")[:150])), "corrupt image"),
    "20k x 20k": (image_part(data_url(png_header(20_000, 20_000))), "larger than"),
    "svg": (
        image_part(data_url(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml")),
        "SVG images are not supported",
    ),
    "not base64": (image_part("data:image/png;base64,@@@@"), "not valid base64"),
    "file outside": (image_part("file:///etc/hostname"), "file: image URLs must point under"),
    "other scheme": (image_part("ftp://example.com/a.png"), r"data:, http\(s\): or file: URLs"),
    "no url": ({"type": "image_url", "image_url": {}}, "needs image_url.url"),
    "audio part": ({"type": "input_audio", "input_audio": {}}, "'input_audio' are not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_input_is_a_clear_400(client, vserver, case):
    part, why = BAD[case]
    with pytest.raises(openai.BadRequestError, match=why):
        ask(client, vserver.model_id, part, max_tokens=2)


def test_an_oversized_http_image_is_refused(client, vserver, image_host):
    with pytest.raises(openai.BadRequestError, match="more than 20971520"):
        ask(client, vserver.model_id, image_part(image_host + "/huge"), max_tokens=2)


def test_too_many_images_is_a_400(client, vserver):
    url = data_url(image_bytes("tall.png"))
    with pytest.raises(openai.BadRequestError, match="3 images in one request, more than the 2"):
        ask(client, vserver.model_id, *[image_part(url)] * 3, max_tokens=2)


def test_an_image_to_a_text_only_model_says_so(server):
    with pytest.raises(openai.BadRequestError, match="this model does not take images"):
        ask(server.openai(), server.model_id, image_part(data_url(image_bytes("tall.png"))),
            max_tokens=2)  # fmt: skip


def test_the_server_refuses_an_mmproj_of_another_model(smollm2_path):
    cmd = [sys.executable, "-m", "localllm.app", "serve", "-m", str(smollm2_path), "--mmproj",
           str(MMPROJ), "--port", "0"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "it belongs to another model" in proc.stderr
