"""Requests that used to get a 500 (and a dropped keep-alive connection), an unbounded amount of
engine time, or a silent yes where peers say no: each is a 4xx in OpenAI's shape now, and the
client's next request on the same connection is answered.
"""

import json
import socket

import openai
import pytest

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "hi"}]


class Connection:
    """One keep-alive HTTP/1.1 connection, spoken by hand: a client library would silently open
    a new connection where the server dropped one, which is what these tests must see."""

    def __init__(self, base: str):
        host, port = base.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=120)
        self.file = self.sock.makefile("rb")

    def post(self, path: str, body: dict | bytes) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n")  # fmt: skip
        self.sock.sendall(head.encode() + data)
        status = self.file.readline()
        assert status, "the server closed the connection"
        headers = {}
        while line := self.file.readline().strip():
            name, value = line.decode().split(":", 1)
            headers[name.lower()] = value.strip()
        assert headers.get("connection") != "close", headers
        return int(status.split()[1]), json.loads(self.file.read(int(headers["content-length"])))

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def _chat(**extra) -> dict:
    return {"messages": MSG, "max_tokens": 2, "temperature": 0, **extra}


BAD = {
    "template kwargs name the messages": ("/v1/chat/completions",
                                          _chat(chat_template_kwargs={"messages": "x"})),
    "template kwargs name the tools": ("/v1/chat/completions",
                                       _chat(chat_template_kwargs={"tools": []})),
    "lone surrogate in content": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
    ),
    "lone surrogate in /tokenize": ("/tokenize", b'{"content": "\\udfff"}'),
    "huge logit bias": ("/v1/chat/completions", _chat(logit_bias={"5": 1e308})),
    "n over the cap": ("/v1/chat/completions", _chat(n=1000, max_tokens=1)),
    "a batch over the cap": ("/v1/completions",
                             {"prompt": ["a"] * 3, "n": 2, "max_tokens": 1}),  # 6 > 4
    "best_of other than n": ("/v1/completions", {"prompt": "a", "best_of": 3, "max_tokens": 1}),
    "tool_choice without tools": ("/v1/chat/completions", _chat(tool_choice="auto")),
    "empty cache_salt": ("/v1/chat/completions", _chat(cache_salt="")),
    "input_extra chunk without text": ("/infill", {"input_prefix": "def f(", "input_extra": [{}]}),
    "continue and a generation prompt": (
        "/v1/chat/completions", _chat(continue_final_message=True, add_generation_prompt=True)),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_a_400_and_the_connection_stays_usable(roomy_server, case):
    path, body = BAD[case]
    conn = Connection(roomy_server.base)
    try:
        status, err = conn.post(path, body)
        assert status == 400, (case, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["type"] == "invalid_request_error"
        status, ok = conn.post("/tokenize", {"content": "hello"})  # same connection
        assert status == 200 and ok["tokens"]
    finally:
        conn.close()


def test_the_caps_leave_room_for_what_they_allow(roomy_server):
    """--max-n defaults to --parallel (4 here): four completions are made, five are not."""
    client = openai.OpenAI(base_url=roomy_server.base + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=roomy_server.model_id, messages=MSG, n=4, max_tokens=1)
    assert len(r.choices) == 4
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=roomy_server.model_id, messages=MSG, n=5, max_tokens=1)
    assert e.value.body["code"] == "too_many_choices" and "--max-n" in e.value.body["message"]
    r = client.completions.create(
        model=roomy_server.model_id, prompt="a", n=2, best_of=2, max_tokens=1
    )
    assert len(r.choices) == 2
