"""ModelRouter: loading on first use, LRU and budget unloading, idle TTL (in process, fake
engines); then a real multi-model `localllm serve --models-dir` subprocess: routing by `model`,
swapping under --max-loaded 1, idle unload, per-model metrics/tokenize/health, and FIM
(/infill, completions `suffix`) on a SmolLM2 copy whose metadata names FIM tokens."""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from localllm.app.server.errors import APIError
from localllm.app.server.router import ModelEntry, ModelRouter, model_files, model_id_for
from localllm.engine.core.outputs import CompletionOutput, RequestOutput
from tests.app.server.conftest import _free_port
from tests.app.server.fim_gguf import with_metadata

A, B, C = (ModelEntry(n, names=frozenset({n + ".gguf"}), nbytes=100) for n in "abc")


class FakeEngine:
    def __init__(self, name: str):
        self.name, self.alive, self.closed = name, True, False
        self.gate = asyncio.Event()

    async def generate(self, prompt, params=None, request_id=None, **kw):
        await self.gate.wait()
        yield RequestOutput(request_id, None, [1], [CompletionOutput(0, "x", [2], "stop")], True)

    def shutdown(self, abort: bool = True) -> None:
        self.closed = True


class Loads:
    """A loader that counts loads per model (it runs in a worker thread)."""

    def __init__(self):
        self.count: dict[str, int] = {}
        self.engines: list[FakeEngine] = []
        self.lock = threading.Lock()
        self.release: threading.Event | None = None

    def __call__(self, entry: ModelEntry) -> FakeEngine:
        if self.release is not None and not self.release.wait(30):
            raise RuntimeError("the event loop was blocked while loading")
        with self.lock:
            self.count[entry.id] = self.count.get(entry.id, 0) + 1
            self.engines.append(FakeEngine(entry.id))
            return self.engines[-1]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _router(entries=(A, B, C), **kw) -> tuple[ModelRouter, Loads, Clock]:
    loads, clock = Loads(), Clock()
    return ModelRouter(list(entries), loads, clock=clock, **kw), loads, clock


async def _finish(handle) -> None:
    handle._engine.gate.set()
    async for _ in handle.generate("p"):
        pass


def test_concurrent_first_requests_load_once_off_the_event_loop():
    async def go():
        router, loads, _ = _router()
        loads.release = threading.Event()
        tasks = [asyncio.ensure_future(router.acquire(A)) for _ in range(8)]
        await asyncio.sleep(0.05)
        assert router.status(A) == "loading"
        loads.release.set()  # only reachable if the loop runs while the loader waits
        handles = await asyncio.gather(*tasks)
        assert loads.count == {"a": 1}
        assert {id(h._engine) for h in handles} == {id(loads.engines[0])}
        assert router.status(A) == "loaded" and router.status(B) == "unloaded"

    asyncio.run(go())


def test_least_recently_used_idle_model_makes_room():
    async def go():
        router, loads, clock = _router(max_loaded=2)
        for entry in (A, B, A):
            await _finish(await router.acquire(entry))
            clock.t += 10
        await router.acquire(C)
        assert [e.id for e, _ in router.loaded()] == ["a", "c"]
        assert [e.closed for e in loads.engines] == [False, True, False]
        assert loads.count == {"a": 1, "b": 1, "c": 1}

    asyncio.run(go())


def test_byte_budget_and_free_memory_unload_idle_models():
    async def go():
        router, loads, clock = _router(memory_budget=150)
        await router.acquire(A)
        clock.t += 10
        await router.acquire(B)  # 100 + 100 > 150: a goes
        assert [e.id for e, _ in router.loaded()] == ["b"] and loads.engines[0].closed
        low, _, clock2 = _router(available=lambda: 50)  # files larger than free memory
        await low.acquire(A)
        clock2.t += 10
        await low.acquire(B)
        assert [e.id for e, _ in low.loaded()] == ["b"]
        busy = await low.acquire(C)  # b was just resolved (busy): no room, load anyway
        assert [e.id for e, _ in low.loaded()] == ["b", "c"]
        await _finish(busy)

    asyncio.run(go())


def test_a_model_with_running_requests_is_never_unloaded():
    async def go():
        router, loads, clock = _router(max_loaded=1)
        handle = await router.acquire(A)
        stream = handle.generate("p")
        running = asyncio.ensure_future(anext(stream))  # a request in flight on a
        await asyncio.sleep(0.01)
        clock.t += 100
        with pytest.raises(APIError) as e:
            await router.acquire(B, timeout=0.3)
        assert e.value.status == 503 and not loads.engines[0].closed
        waiting = asyncio.ensure_future(router.acquire(B))
        await asyncio.sleep(0.3)
        assert not waiting.done() and router.status(B) == "unloaded"
        handle._engine.gate.set()
        await running
        await stream.aclose()  # the request ends: now a may go (after the resolve grace)
        clock.t += 10
        await waiting
        assert loads.engines[0].closed and [e.id for e, _ in router.loaded()] == ["b"]

    asyncio.run(go())


def test_idle_ttl_unloads_and_the_next_request_loads_again():
    async def go():
        router, loads, clock = _router(idle_unload=10)
        await _finish(await router.acquire(A))  # last used at t0
        clock.t += 9.5
        assert await router.unload_idle() == []
        clock.t += 1
        assert await router.unload_idle() == ["a"]
        assert loads.engines[0].closed and router.status(A) == "unloaded"
        await router.acquire(A)
        assert loads.count == {"a": 2}
        router.shutdown()

    asyncio.run(go())


def test_names_default_unknown_and_failed_loads():
    router, _, _ = _router()
    assert router.find(None) is A and router.find("") is A and router.find("b.gguf") is B
    with pytest.raises(APIError) as e:
        router.find("gpt-4o")
    assert e.value.status == 404 and "'a', 'b', 'c'" in e.value.message
    with pytest.raises(ValueError, match="unique"):
        ModelRouter([A, A], Loads())

    calls = []

    def flaky(entry):
        calls.append(entry.id)
        if len(calls) == 1:
            raise OSError("disk on fire")
        return FakeEngine(entry.id)

    async def go():
        r = ModelRouter([A], flaky)
        with pytest.raises(APIError) as e:
            await r.acquire(A)
        assert e.value.status == 500 and "disk on fire" in e.value.message
        assert r.status(A) == "unloaded"
        await r.acquire(A)  # a failed load is retried by the next request
        assert r.status(A) == "loaded" and calls == ["a", "a"]

    asyncio.run(go())


def test_models_dir_files_ids_and_serve_flags(smollm2_path, tmp_path):
    from localllm.app.serve import _entries, parse_bytes

    for name in ("a.gguf", "sub/b-00001-of-00002.gguf", "sub/b-00002-of-00002.gguf",
                 "sub/mmproj-a-f16.gguf", "notes.txt"):  # fmt: skip
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    files = model_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in files] == [
        "a.gguf", "sub/b-00001-of-00002.gguf"]  # fmt: skip
    assert [model_id_for(p) for p in files] == ["a", "b"]
    assert parse_bytes("8G") == 8 << 30 and parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("1000") == 1000

    def args(**kw):
        base = {"model": None, "models_dir": None, "alias": None, "ctx_size": 256}
        return argparse.Namespace(**{**base, **kw})

    root = tmp_path / "lib"
    for d in ("x", "y"):  # the same file name in two folders: the path tells them apart
        (root / d).mkdir(parents=True)
        (root / d / smollm2_path.name).symlink_to(smollm2_path)
    entries = _entries(args(models_dir=str(root)))
    assert [e.id for e in entries] == [str(root / d / smollm2_path.stem) for d in "xy"]
    assert entries[0].context_length == 256 and entries[0].nbytes > 50_000_000
    one = _entries(args(model=[str(smollm2_path)], alias="smol"))
    assert one[0].id == "smol" and one[0].matches(smollm2_path.name) and not one[0].fim
    with pytest.raises(ValueError, match="twice"):
        _entries(args(model=[str(smollm2_path), str(smollm2_path)]))
    with pytest.raises(ValueError, match="alias"):
        _entries(args(model=[str(smollm2_path)], models_dir=str(root / "x"), alias="s"))


def test_models_dir_finds_hugging_face_folders(tmp_path):
    """A `save_pretrained` folder is a model named by its folder (dots and all), a Hub cache
    snapshot by its repository; a folder of a kind we do not run (MusicGen) is not listed."""
    pytest.importorskip("transformers")
    from localllm.app.serve import _entries
    from tests.engine.hf_fixtures import save_tiny

    lib = tmp_path / "lib"
    folder = save_tiny("qwen3", lib / "Qwen2.5-tiny")
    snap = lib / "hub" / "models--org--Tiny-Chat" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).symlink_to(f)
    music = lib / "musicgen-small"
    music.mkdir()
    (music / "config.json").write_text(
        json.dumps({"architectures": ["MusicgenForConditionalGeneration"]})
    )
    (music / "model.safetensors").write_bytes(b"")
    (lib / "broken").mkdir()
    (lib / "broken" / "config.json").write_text("{not json")
    (lib / "broken" / "model.safetensors").write_bytes(b"")
    files = model_files(lib)
    assert files == [folder, snap]
    assert [model_id_for(p) for p in files] == ["Qwen2.5-tiny", "Tiny-Chat"]
    args = argparse.Namespace(model=None, models_dir=str(lib), alias=None, ctx_size=128)
    entries = _entries(args)
    assert [e.id for e in entries] == ["Qwen2.5-tiny", "Tiny-Chat"]
    assert all(e.context_length == 128 and e.nbytes > 10_000 and e.generates for e in entries)
    assert entries[0].matches(str(folder)) and not entries[0].matches("Qwen2.5-tiny.5")


# -- the real server ---------------------------------------------------------------------------

PLAIN, FIM = "SmolLM2-135M-Instruct.Q4_1", "smol-fim"
FIM_IDS = {"tokenizer.ggml.fim_pre_token_id": 3, "tokenizer.ggml.fim_suf_token_id": 4,
           "tokenizer.ggml.fim_mid_token_id": 5}  # fmt: skip
IDLE = 8.0


class Multi:
    def __init__(self, base: str):
        self.base = base
        self.http = httpx.Client(base_url=base, timeout=120)
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)

    def status(self) -> dict[str, str]:
        return {m["id"]: m["status"] for m in self.http.get("/v1/models").json()["data"]}

    def complete(self, model: str, **kw):
        kw = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, **kw}
        return self.client.completions.create(model=model, **kw)


@pytest.fixture(scope="module")
def multi(smollm2_path, tmp_path_factory) -> Iterator[Multi]:
    root = tmp_path_factory.mktemp("models")
    (root / smollm2_path.name).symlink_to(smollm2_path)
    (root / "sub").mkdir()  # found recursively
    with_metadata(smollm2_path, root / "sub" / f"{FIM}.gguf", FIM_IDS)
    port = _free_port()
    cmd = [sys.executable, "-m", "localllm.app", "serve", "--models-dir", str(root),
           "--port", str(port), "--ctx-size", "512", "--parallel", "4", "--max-loaded", "1",
           "--idle-unload", str(IDLE)]  # fmt: skip
    log = root / "stderr.txt"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                env=dict(os.environ, PYTHONSAFEPATH="1"))  # fmt: skip
        try:
            base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    if httpx.get(base + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "server did not become healthy"
                time.sleep(0.3)
            yield Multi(base)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_status(multi: Multi, want: dict[str, str], limit: float = 120.0) -> None:
    end = time.monotonic() + limit
    while multi.status() != want:
        assert time.monotonic() < end, multi.status()
        time.sleep(0.2)


# The tests run in file order and load each model once (loads are slow on a busy 2-core box).


@pytest.mark.slow
def test_models_list_every_servable_model_with_status(multi):
    data = {m["id"]: m for m in multi.http.get("/v1/models").json()["data"]}
    assert set(data) == {PLAIN, FIM}
    for m in data.values():
        assert m["context_length"] == 512 and m["object"] == "model"
        assert m["status"] == "unloaded"  # nothing loads before its first request
    assert "infill" in data[FIM]["capabilities"] and "infill" not in data[PLAIN]["capabilities"]
    assert multi.http.get("/health").json() == {"status": "ok"}


PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"


def _fim_reference(multi: Multi) -> tuple[list[int], str]:
    """The PSM ids built here from /tokenize, and their greedy completion as a plain prompt."""

    def enc(s: str) -> list[int]:
        body = {"content": s, "add_special": False, "model": FIM}
        return multi.http.post("/tokenize", json=body).json()["tokens"]

    ids = [3, *enc(PREFIX), 4, *enc(SUFFIX), 5]
    return ids, multi.complete(FIM, prompt=ids, max_tokens=10).choices[0].text


@pytest.mark.slow
def test_completions_suffix_and_infill_use_the_psm_prompt(multi):
    ids, expected = _fim_reference(multi)
    got = multi.complete(FIM, prompt=PREFIX, suffix=SUFFIX, max_tokens=10)
    assert got.usage.prompt_tokens == len(ids) and got.choices[0].text == expected
    streamed = multi.complete(FIM, prompt=PREFIX, suffix=SUFFIX, max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    body = {"model": FIM, "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 10,
            "temperature": 0}  # fmt: skip
    r = multi.http.post("/infill", json=body).json()
    assert r["content"] == expected and r["tokens_evaluated"] == len(ids)
    assert r["stop"] is True and r["tokens_predicted"] == 10 and r["stop_type"] == "limit"
    events = []
    with multi.http.stream("POST", "/infill", json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert "".join(e["content"] for e in events) == expected
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])
    assert events[-1]["tokens_predicted"] == 10


@pytest.mark.slow
def test_fim_bad_requests(multi):
    r = multi.http.post("/infill", json={"model": FIM, "input_prefix": "a", "n": 2})
    assert r.status_code == 400 and r.json()["error"]["message"]
    # llama-server's rule: every input_extra chunk has a text (an empty one used to pass).
    r = multi.http.post("/infill", json={"model": FIM, "input_prefix": "a", "input_extra": [{}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_extra.0.text"
    with pytest.raises(openai.BadRequestError):
        multi.complete(FIM, suffix="x", echo=True)
    with pytest.raises(openai.BadRequestError):
        multi.complete(FIM, prompt=[1, 2, 3], suffix="x")


@pytest.mark.slow
def test_the_request_model_picks_the_engine_and_max_loaded_swaps(multi):
    before = multi.http.get("/metrics").text
    b = multi.complete(FIM + ".gguf")  # the file name works as the id too
    assert b.model == FIM and multi.status() == {PLAIN: "unloaded", FIM: "loaded"}
    a = multi.complete(PLAIN)
    assert a.model == PLAIN and multi.status() == {PLAIN: "loaded", FIM: "unloaded"}
    assert b.choices[0].text == a.choices[0].text  # the same weights, greedy
    health = multi.http.get("/health", params={"model": FIM}).json()
    assert health == {"status": "ok", "model": FIM, "model_status": "unloaded"}
    text = multi.http.get("/metrics").text
    for model in (PLAIN, FIM):
        line = f'vllm:generation_tokens_total{{model_name="{model}"}}'
        was = [x for x in before.splitlines() if x.startswith(line)]
        now = [x for x in text.splitlines() if x.startswith(line)]
        assert float(now[0].split()[-1]) - float(was[0].split()[-1]) == 8.0
    assert f'localllm:model_loaded{{model_name="{PLAIN}"}} 1.0' in text.splitlines()
    assert f'vllm:kv_cache_usage_perc{{model_name="{FIM}"}}' not in text  # not loaded
    only = multi.http.get("/metrics", params={"model": PLAIN}).text
    assert FIM not in only and PLAIN in only
    ids = multi.http.post("/tokenize", json={"content": "Hello there", "model": PLAIN}).json()
    assert multi.http.post("/detokenize", json={**ids, "model": PLAIN}).json() == {
        "content": "Hello there"
    }
    with pytest.raises(openai.NotFoundError):
        multi.complete("nope")
    r = multi.http.post("/infill", json={"model": PLAIN, "input_prefix": "a"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "fim_unsupported"
    with pytest.raises(openai.BadRequestError) as e:
        multi.complete(PLAIN, suffix="x")
    assert e.value.body["code"] == "fim_unsupported"


@pytest.mark.slow
def test_idle_models_unload(multi):
    multi.complete(PLAIN, max_tokens=2)
    _wait_status(multi, {PLAIN: "unloaded", FIM: "unloaded"})  # after --idle-unload seconds
