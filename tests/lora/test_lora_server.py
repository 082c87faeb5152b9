"""`localllm serve --lora ... --lora-modules NAME=PATH` over a real socket with the `openai` client.

The CLI in a subprocess on a port the system picks, on the tiny llama folder with llama.cpp's
GGUF of adapter `llama-a` at global scale 0 (id 0) and the PEFT folder `llama-b` served as model
`sql` (id 1). Each answer is the in-process engine's for the same adapters: the plain model (both
at 0), a request's llama-server `lora` field, model=`sql`, and after POST /lora-adapters sets
adapter 0's global scale to 1, a request naming none.
"""

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from localllm.engine import EngineArgs, LLMEngine, SamplingParams
from localllm.engine.lora import LoraSpec
from tests.lora.lora_refs import HF, LORA

GUARD_S = 300  # a hung start-up fails the test instead of the run (not a speed requirement)
PROMPT = "Hello, world! The quick brown"
A, B = str(LORA / "llama-a.gguf"), str(LORA / "llama-b")


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def engine_answers() -> dict[str, str]:
    specs = (LoraSpec(A, 0.0), LoraSpec(B, 0.0, "sql", served=True))
    e = LLMEngine(str(HF / "llama"), EngineArgs(lora=specs))
    choices = {"base": None, "a": ((0, 1.0),), "sql": ((1, 1.0),), "a-half": ((0, 0.5),)}
    for name, lora in choices.items():
        e.add_request(name, PROMPT, SamplingParams(temperature=0, max_tokens=8, lora=lora))
    text = {}
    while e.has_unfinished_requests():
        for out in e.step():
            text[out.request_id] = out.outputs[0].text
    e.close()
    return text


def test_serve_lora_adapters_answer_the_openai_client(tmp_path):
    openai = pytest.importorskip("openai")
    want = engine_answers()
    assert len(set(want.values())) == len(want)  # every choice answers differently
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", LOCALLLM_MODEL_DIRS="")
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    cmd = [sys.executable, "-m", "localllm.app", "serve", "-m", str(HF / "llama"), "--port", "0",
           "--lora", f"{A}:0", "--lora-modules", f"sql={B}"]  # fmt: skip
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
        root = url.group(0).removesuffix("/v1")
        client = openai.OpenAI(base_url=url.group(0), api_key="x")
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"llama", "sql"}
        assert models["sql"].parent == "llama" and models["sql"].root == B

        def ask(model="llama", **extra):
            r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                          temperature=0, extra_body=extra or None)  # fmt: skip
            return r.model, r.choices[0].text

        adapters = httpx.get(f"{root}/lora-adapters").json()
        assert [(a["id"], a["path"], a["scale"]) for a in adapters] == [(0, A, 0.0), (1, B, 0.0)]
        assert ask() == ("llama", want["base"])
        assert ask(lora=[{"id": 0, "scale": 1.0}]) == ("llama", want["a"])
        assert ask(lora=[{"id": 0, "scale": 0.5}]) == ("llama", want["a-half"])
        assert ask("sql") == ("sql", want["sql"])
        r = httpx.post(f"{root}/lora-adapters", json=[{"id": 0, "scale": 1.0}])
        assert r.json() == {"success": True}
        assert httpx.get(f"{root}/lora-adapters").json()[0]["scale"] == 1.0
        assert ask() == ("llama", want["a"])
        bad = httpx.post(f"{root}/v1/completions",
                         json={"prompt": PROMPT, "lora": [{"id": 7, "scale": 1}]})  # fmt: skip
        assert bad.status_code == 400 and "lora id 7" in bad.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=GUARD_S)
