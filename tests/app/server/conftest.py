"""A real `localllm serve` subprocess on a free loopback port (SmolLM2), shared by the session.

It runs with an API key and a small body limit so the auth and size guards are exercised on the
real server; clients get the key through `server.headers` / `server.openai()`.
"""

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "test-key-123"
MAX_BODY = 64 * 1024
CTX = 1024
PARALLEL = 8


@dataclass
class Server:
    base: str  # http://127.0.0.1:PORT
    model_id: str
    proc: subprocess.Popen

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def openai(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers=self.headers, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by their full name with labels (minus model_name)."""
        text = httpx.get(self.base + "/metrics", headers=self.headers, timeout=30).text
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line:
                continue
            name, value = line.rsplit(" ", 1)
            out[name.replace(f'model_name="{self.model_id}",', "").replace(
                f'{{model_name="{self.model_id}"}}', "")] = float(value)  # fmt: skip
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(args: list[str], logdir: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`localllm serve ARGS --port <free>` as a subprocess; yields (base URL, process) once
    /health answers, and stops it afterwards. Stderr goes to a file: a full pipe would block it."""
    port = _free_port()
    cmd = [sys.executable, "-m", "localllm.app", "serve", *args, "--port", str(port)]
    env = dict(os.environ, PYTHONSAFEPATH="1")
    log = logdir / "stderr.txt"
    err = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()}")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy")
            time.sleep(0.3)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err.close()


@pytest.fixture(scope="session")
def server(smollm2_path, tmp_path_factory) -> Iterator[Server]:
    args = ["-m", str(smollm2_path), "--ctx-size", str(CTX), "--parallel", str(PARALLEL),
            "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY)]  # fmt: skip
    with serve_process(args, tmp_path_factory.mktemp("serve")) as (base, proc):
        yield Server(base, smollm2_path.stem, proc)


READ_TIMEOUT = 2.0
MAX_CONNECTIONS = 48


@pytest.fixture(scope="session")
def roomy_server(smollm2_path, tmp_path_factory) -> Iterator[Server]:
    """The default body limit (8 MiB) and the model's whole context, for big requests; short
    read deadlines and a small connection cap, for slow and greedy clients."""
    args = ["-m", str(smollm2_path), "--parallel", "4", "--read-timeout", str(READ_TIMEOUT),
            "--max-connections", str(MAX_CONNECTIONS)]  # fmt: skip
    with serve_process(args, tmp_path_factory.mktemp("serve-roomy")) as (base, proc):
        yield Server(base, smollm2_path.stem, proc)
