"""`localllm serve -m DIR` on a Hugging Face folder (tests/data/hf/qwen3): the real CLI in a
subprocess on a port the system picks, asked by the official `openai` client over the socket;
its greedy chat answer is the engine's own on the folder."""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from localllm.engine import EngineArgs, LLMEngine, SamplingParams

DATA = Path(__file__).parents[1] / "data" / "hf" / "qwen3"
GUARD_S = 300  # a hung start-up fails the test instead of the run (not a speed requirement)
MESSAGES = [{"role": "user", "content": "Hello, world"}]


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def engine_answer() -> str:
    e = LLMEngine(str(DATA), EngineArgs())
    e.add_request("a", e.chat_prompt(MESSAGES), SamplingParams(temperature=0, max_tokens=8))
    text = ""
    while e.has_unfinished_requests():
        for out in e.step():
            text = out.outputs[0].text
    e.close()
    return text


def test_serve_a_folder_answers_the_openai_client(tmp_path):
    openai = pytest.importorskip("openai")
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", LOCALLLM_MODEL_DIRS="")
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    cmd = [sys.executable, "-m", "localllm.app", "serve", "-m", str(DATA), "--port", "0"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        said = []
        while (line := lines.get(timeout=GUARD_S)) is not None:
            said.append(line)
            if " on http://" in line:
                break
        url = re.search(r"http://127\.0\.0\.1:\d+/v1$", said[-1])
        assert url, said
        client = openai.OpenAI(base_url=url.group(0), api_key="x")
        assert [m.id for m in client.models.list().data] == ["qwen3"]
        r = client.chat.completions.create(
            model="qwen3", messages=MESSAGES, max_tokens=8, temperature=0
        )
        assert r.choices[0].message.content == engine_answer()
        assert r.usage.completion_tokens == 8
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=GUARD_S)
