"""Chat templates that run to their time limit render in worker threads: four such chats run
side by side (each to its own 2 s deadline) and /health keeps answering meanwhile.

Before, rendering ran on the event loop: the four were answered 2 s apart and /health waited
behind them.
"""

import threading
import time

import httpx
import pytest

from tests.app.server.conftest import serve_process
from tests.app.test_cli_hostile_template import _tiny_chat_model

pytestmark = pytest.mark.slow

# Runs until the renderer's deadline (2 s by default) stops it.
ENDLESS = (
    "{% for i in range(99999) %}{% for j in range(99999) %}{% if i < 0 %}x{% endif %}"
    "{% endfor %}{% endfor %}"
)


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    model = _tiny_chat_model(tmp_path_factory.mktemp("slow") / "slow.gguf", ENDLESS)
    with serve_process(["-m", str(model)], tmp_path_factory.mktemp("serve-slow")) as (base, _):
        yield base


def test_four_slow_templates_render_side_by_side(slow_server):
    done: list[tuple[float, httpx.Response]] = []

    def chat() -> None:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(slow_server + "/v1/chat/completions", json=body, timeout=60)
        done.append((time.perf_counter(), r))

    health_times = []
    with httpx.Client(base_url=slow_server, timeout=30) as health:
        health.get("/health")
        threads = [threading.Thread(target=chat) for _ in range(4)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            s = time.perf_counter()
            assert health.get("/health").status_code == 200
            health_times.append(time.perf_counter() - s)
            time.sleep(0.05)
    for _, r in done:
        assert r.status_code == 400, r.text
        assert "longer than the render time limit" in r.json()["error"]["message"]
    assert len(done) == 4 and len(health_times) >= 3  # polled while they rendered
    # Four threads holding the GIL in turn slow the loop a little (0.03-0.11 s seen, once 1.13 s
    # on a box running other work); on the loop itself /health waited 5.96 s behind them.
    assert max(health_times) < 2.0, max(health_times)
