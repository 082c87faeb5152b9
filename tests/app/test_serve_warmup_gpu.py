"""On a GPU (marked `gpu`): after `serve --warmup full`'s start-up, no request captures a CUDA
graph or meets a triton kernel it has not loaded (issue 38: one request of eight waited 6.9 s
for its first token, a prompt length met for the first time).

An engine on the tiny synthetic model (Q4_K_M: the triton GEMVs and dequantizers, 8 sequences,
256-token steps, 1,024-token context) is warmed, then serves prompts of assorted lengths one at
a time and then together (greedy, drawn and penalized rows, joining while others decode): the
graphs it holds stay the same, and triton's own hook (`jit_cache_hook`, called on every kernel
specialization a process meets for the first time, before it is compiled or read from disk)
never fires. A server subprocess says its warm-up before its URL.

It lives outside tests/app/server/: that folder's conftest imports the openai client, which the
GPU image lacks (the 12:25 UTC 2026-12-06 call stopped at collection there)."""

import dataclasses
import os
import queue
import re
import subprocess
import sys
import threading

import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine, SamplingParams
from localllm.engine.runtime.warmup import engine_plan, warm_engine
from tests.perf.make_synthetic import SHAPES, write_synthetic

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GUARD_S = 300  # a hung start-up fails the test instead of the run (not a speed requirement)
LENGTHS = (1, 5, 31, 32, 33, 47, 100, 255, 256, 257, 300, 513, 900)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm_gpu") / "tiny.gguf"
    write_synthetic(path, dataclasses.replace(SHAPES["tiny"], vocab=512), "Q4_K_M", None, seed=4)
    return path


class _Compiles:
    """Triton kernels met for the first time while installed (their launch reprs)."""

    def __init__(self):
        import triton

        self.seen: list[str] = []
        knobs = getattr(triton, "knobs", None)
        self.owner = knobs.runtime if knobs is not None else triton.runtime.jit.JITFunction
        self.name = "jit_cache_hook" if knobs is not None else "cache_hook"

    def hook(self, *args, **kw) -> bool:
        self.seen.append(str(kw.get("repr", kw.get("fn"))))
        return False  # compile as usual

    def __enter__(self):
        self.old = getattr(self.owner, self.name)
        setattr(self.owner, self.name, self.hook)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.old)


def _graphs(engine) -> set:
    r = engine.runner
    return {("decode", k) for k in r.graphs.graphs} | {("prompt", k) for k in r.prompts.graphs}


def _run(engine, requests) -> None:
    for i, (ids, params) in enumerate(requests):
        engine.add_request(None, ids, params)
        if i % 2:  # the next one joins while these decode
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def test_no_capture_or_compile_after_warm_up(tiny):
    args = EngineArgs(device="cuda", max_num_seqs=8, max_num_batched_tokens=256,
                      max_model_len=1024)  # fmt: skip
    engine = LLMEngine(str(tiny), args)
    try:
        p = engine_plan(engine, "full")
        report = warm_engine(engine, "full")
        assert report.failed is None, report.failed
        assert report.captured == len(p.decode) + len(p.buckets) == len(_graphs(engine))
        made = _graphs(engine)
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        drawn = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=12, ignore_eos=True)
        penal = SamplingParams(temperature=0.7, top_k=20, presence_penalty=0.5, seed=6,
                               max_tokens=12, ignore_eos=True)  # fmt: skip
        kinds = (greedy, drawn, penal)
        prompt = lambda n, s: [(3 + 37 * (s * 1009 + j)) % 509 + 3 for j in range(n)]
        with _Compiles() as compiles:
            for i, n in enumerate(LENGTHS):  # one at a time: each length's own steps
                _run(engine, [(prompt(n, i), kinds[i % 3])])
            together = [(prompt(n, 100 + i), kinds[i % 3]) for i, n in enumerate(LENGTHS[::-1])]
            _run(engine, together[:8])
        torch.cuda.synchronize()
        assert _graphs(engine) == made, sorted(_graphs(engine) - made)
        assert compiles.seen == [], compiles.seen
    finally:
        engine.close()


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def test_server_warms_before_it_listens(tiny, tmp_path):
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", LOCALLLM_MODEL_DIRS="")
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    cmd = [sys.executable, "-m", "localllm.app", "serve", "-m", str(tiny), "--device", "cuda",
           "--port", "0", "-np", "8", "-c", "1024"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        said = []
        while (line := lines.get(timeout=GUARD_S)) is not None:
            said.append(line)
            if " on http://" in line:
                break
        warm = [i for i, s in enumerate(said) if s.startswith("localllm: warm-up full: ")]
        assert warm and said[-1].startswith("localllm: serving "), said
        assert warm[0] < len(said) - 1  # said (and done) before the URL: before any request
        m = re.search(r"warm-up full: (\d+) graphs in ([\d.]+) s$", said[warm[0]])
        assert m and int(m.group(1)) > 0, said[warm[0]]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
