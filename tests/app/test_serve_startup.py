"""`localllm serve` says what it loads before the load, and its URL once clients can connect:
the real CLI in a subprocess, on the embedded default model and a port the system picks."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest

pytestmark = pytest.mark.slow

GUARD_S = 300  # a hung start-up fails the test instead of the run (not a speed requirement)


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def test_serve_names_the_model_it_loads_then_the_url_when_ready(smollm2_path, tmp_path):
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", LOCALLLM_MODEL_DIRS="")
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    env.pop("LOCALLLM_MODEL", None)
    cmd = [sys.executable, "-m", "localllm.app", "serve", "--port", "0"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        first = lines.get(timeout=GUARD_S)
        # said before the weights are read: which file, how big, from where
        assert first is not None, proc.wait()
        assert re.fullmatch(
            rf"localllm: loading {re.escape(smollm2_path.name)} \(9\d\.\d MB of weights\) from "
            + re.escape(str(smollm2_path.parent)),
            first,
        ), first
        said = []
        while (line := lines.get(timeout=GUARD_S)) is not None:
            said.append(line)
            if " on http://" in line:
                break
        assert said and said[-1].startswith("localllm: serving "), said
        assert said[:-1] == [said[0]] and said[0].startswith("localllm: loaded in "), said
        url = re.search(r"http://127\.0\.0\.1:(\d+)/v1$", said[-1])
        assert url and url.group(1) != "0", said[-1]  # the port it listens on, not the flag's 0
        # ready means ready: the first request, sent the moment the line is read, is answered
        with urllib.request.urlopen(url.group(0) + "/models", timeout=GUARD_S) as r:
            ids = [m["id"] for m in json.load(r)["data"]]
        assert ids == [smollm2_path.stem]
        assert f"serving {smollm2_path.stem} (context 8192) on " in said[-1]
        proc.send_signal(signal.SIGINT)  # Ctrl+C: a clean stop, exit 0, as before
        assert proc.wait(timeout=GUARD_S) == 0
        rest = []
        while (line := lines.get(timeout=GUARD_S)) is not None:
            rest.append(line)
        assert not [line for line in rest if "Traceback" in line], rest
    finally:
        proc.terminate()
        proc.wait(timeout=60)
