"""Slow and greedy clients against the real server: half-sent requests are closed at the read
deadline (before the fix 200 of them stayed open forever), a body that stalls gets a 408, and
connections beyond `--max-connections` get 503 while the others are served.
"""

import socket
import time

import httpx
import pytest

from tests.app.server.conftest import MAX_CONNECTIONS, READ_TIMEOUT

pytestmark = pytest.mark.slow


def _open(base: str, first_bytes: bytes) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=READ_TIMEOUT + 10)
    s.sendall(first_bytes)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_half_sent_headers_are_closed_at_the_read_deadline(roomy_server):
    slow = [_open(roomy_server.base, b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nCont")
            for _ in range(20)]  # fmt: skip
    t0 = time.monotonic()
    try:
        assert httpx.get(roomy_server.base + "/health", timeout=5).status_code == 200
        for s in slow:
            assert _read_all(s) == b""  # closed by the server, no answer to a half request
        waited = time.monotonic() - t0
        assert READ_TIMEOUT - 0.5 <= waited <= READ_TIMEOUT + 5, waited
    finally:
        for s in slow:
            s.close()


def test_a_stalled_body_gets_408_and_the_connection_closes(roomy_server):
    head = (b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")  # fmt: skip
    s = _open(roomy_server.base, head + b'{"content": "so')
    try:
        answer = _read_all(s)  # ends: the server closes after answering
    finally:
        s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in answer.lower()
    assert b'"code": "body_timeout"' in answer or b'"code":"body_timeout"' in answer


def test_a_keep_alive_connection_gets_the_deadline_again_for_its_next_request(roomy_server):
    s = _open(roomy_server.base, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    try:
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request, never finished
        t0 = time.monotonic()
        assert _read_all(s) == b""
        assert time.monotonic() - t0 <= READ_TIMEOUT + 5
    finally:
        s.close()


def test_connections_beyond_the_cap_get_503_until_the_slow_ones_are_gone(roomy_server):
    hogs = [_open(roomy_server.base, b"GET /health HTTP/1.1\r\n") for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # the server has accepted them all
        assert httpx.get(roomy_server.base + "/health", timeout=5).status_code == 503
        for s in hogs:
            _read_all(s)  # closed at the read deadline
    finally:
        for s in hogs:
            s.close()
    time.sleep(0.2)
    assert httpx.get(roomy_server.base + "/health", timeout=5).status_code == 200
