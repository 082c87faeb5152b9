"""Expert streaming options: read-ahead on the next layer's router guess (a background read into
a free or evictable slot, never the current layer's experts), LFU eviction, their counters, and
greedy output identical to the all-resident run in every combination."""

import itertools
from types import SimpleNamespace

import gguf
import pytest
import torch

from localllm.app.cli import build_parser
from localllm.app.residency_flags import residency_config
from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import moe_blocks
from localllm.engine.moe.residency import load_model, plan_model
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.expert_cache import StreamedExperts
from localllm.offload.expert_source import ExpertLayout
from localllm.offload.expert_stats import expert_stats
from localllm.offload.memory import MemoryInfo
from localllm.offload.ranges import ByteRange
from localllm.offload.residency import ResidencyError, load_document, resolve
from tests.offload.tiny_moe import MIXTRAL, MoESpec, write_moe_gguf

PROMPT = [1, 5, 9, 33, 7, 11, 200, 3]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MEMORY = MemoryInfo("cpu", host_free=1 << 30)
THREE = MoESpec(n_layers=3, n_expert=16)  # 48 experts, top-2


def _cache(tmp_path, n_expert: int, slots: int, **kw) -> tuple[StreamedExperts, bytes]:
    """One layer of `n_expert` experts of 3 x 4 bytes each (gate, up, down of [1, 4])."""
    data = bytes(range(256))
    path = tmp_path / "blob"
    path.write_bytes(data)
    ranges = tuple(ByteRange(str(path), off, 4 * n_expert) for off in (0, 64, 128))
    layout = ExpertLayout(n_expert, ranges, ((1, 4), (1, 4), (1, 4)))
    return StreamedExperts({0: layout, 1: layout}, slots, **kw), data


def _check(blocks, data: bytes, e: int) -> None:
    got = torch.cat([blocks.gate, blocks.up, blocks.down], 1).reshape(-1).tolist()
    assert got == [
        *data[4 * e : 4 * e + 4],
        *data[64 + 4 * e : 68 + 4 * e],
        *data[128 + 4 * e :][:4],
    ]


def test_read_ahead_fills_free_slots_and_serves_hits(tmp_path):
    cache, data = _cache(tmp_path, 8, slots=4, prefetch=True)
    cache.routed(0, torch.tensor([[0, 1]]))
    _check(cache.fetch(0, 0), data, 0)
    _check(cache.fetch(0, 1), data, 1)
    cache.guess(1, [5, 6, 7])  # two free slots: 5 and 6 are read ahead; 7 would evict a
    assert cache.stats.prefetched == 2  # pinned expert of layer 0, so it is skipped
    cache.routed(1, torch.tensor([[5, 7]]))
    assert (cache.stats.guessed, cache.stats.guessed_right) == (3, 2)
    before = cache.stats.snapshot()
    _check(cache.fetch(1, 5), data, 5)  # read ahead: a hit
    _check(cache.fetch(1, 7), data, 7)  # not read ahead: a miss
    s = cache.stats
    assert (s.hits - before.hits, s.misses - before.misses, s.prefetch_hits) == (1, 1, 1)
    cache.close()
    assert s.bytes_read == (s.misses + s.prefetched) * 12  # every read counted once
    assert s.read_gbps > 0 and s.guess_rate == pytest.approx(2 / 3)


def test_a_failed_read_ahead_leaves_a_miss_that_reads_again(tmp_path, caplog):
    """A read-ahead that fails (an I/O error on its thread) is logged, its slot freed, and the
    expert read in the foreground when the layer uses it: nothing is raised into the step."""
    cache, data = _cache(tmp_path, 8, slots=2, prefetch=True)
    real = cache._read

    def broken(slot, layout, expert):
        raise OSError(5, "Input/output error")

    cache._read = broken
    cache.guess(1, [5])
    cache.drain()
    assert "read-ahead of layer 1 expert 5 failed" in caplog.text
    cache._read = real
    cache.routed(1, torch.tensor([[5]]))
    _check(cache.fetch(1, 5), data, 5)
    s = cache.stats
    assert (s.prefetched, s.prefetch_hits, s.misses, s.hits) == (1, 0, 1, 0)
    cache.close()


def test_read_ahead_evicts_only_unpinned_slots(tmp_path):
    cache, data = _cache(tmp_path, 8, slots=3, prefetch=True)
    cache.routed(0, torch.tensor([[0, 1, 2]]))
    for e in (0, 1, 2):
        cache.fetch(0, e)
    cache.guess(1, [3])  # every slot holds a pinned expert of layer 0: nothing is read
    assert cache.stats.prefetched == 0
    cache.routed(0, torch.tensor([[2]]))  # a new step pins only expert 2
    cache.fetch(0, 2)
    cache.guess(1, [3, 4, 5])  # 0 and 1 are evictable (oldest first), 2 is not
    assert cache.stats.prefetched == 2
    cache.routed(1, torch.tensor([[3, 4]]))
    misses = cache.stats.misses
    _check(cache.fetch(1, 3), data, 3)
    _check(cache.fetch(1, 4), data, 4)
    _check(cache.fetch(0, 2), data, 2)  # survived the read-ahead
    assert cache.stats.misses == misses
    cache.close()


def test_a_miss_spares_the_layers_other_experts(tmp_path):
    """Two slots: expert (1, 5) from the last step is the oldest, but layer 1 routes to it now,
    so the miss on (1, 3) evicts (0, 0) instead and (1, 5) is still a hit."""
    cache, data = _cache(tmp_path, 8, slots=2)
    cache.fetch(1, 5)
    cache.fetch(0, 0)
    cache.routed(1, torch.tensor([[3, 5]]))
    _check(cache.fetch(1, 3), data, 3)
    before = cache.stats.hits
    _check(cache.fetch(1, 5), data, 5)
    assert cache.stats.hits == before + 1
    cache.close()


def test_a_wrong_guess_is_evicted_first(tmp_path):
    cache, data = _cache(tmp_path, 8, slots=3, prefetch=True)
    cache.routed(0, torch.tensor([[0]]))
    cache.fetch(0, 0)
    cache.guess(1, [5, 6])  # both read ahead into the two free slots
    cache._worker.shutdown(wait=True)  # let both reads land before layer 1 routes
    cache.routed(1, torch.tensor([[5, 7]]))  # 6 was a wrong guess
    _check(cache.fetch(1, 5), data, 5)
    _check(cache.fetch(1, 7), data, 7)  # the miss evicts 6, not the older (0, 0)
    before = cache.stats.misses
    _check(cache.fetch(0, 0), data, 0)
    assert cache.stats.misses == before and cache.stats.prefetch_hits == 1
    cache.close()


def test_lfu_keeps_the_often_used_expert(tmp_path):
    """Expert 0 is used three times, then 1, 2, 3 once each with 2 slots: LRU evicts 0 at the
    first miss after it aged, LFU keeps it (it is never the least used), so 0 hits again."""
    seq = [0, 0, 0, 1, 2, 3, 0]
    results = {}
    for evict in ("lru", "lfu"):
        cache, data = _cache(tmp_path, 8, slots=2, evict=evict)
        hits = []
        for e in seq:
            before = cache.stats.hits
            _check(cache.fetch(0, e), data, e)
            hits.append(cache.stats.hits > before)
        results[evict] = hits
        cache.close()
    assert results["lru"] == [False, True, True, False, False, False, False]
    assert results["lfu"] == [False, True, True, False, False, False, True]
    with pytest.raises(ValueError, match="lru or lfu"):
        _cache(tmp_path, 8, slots=2, evict="fifo")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("pf")
    return {
        "qwen3moe": write_moe_gguf(d / "q.gguf", THREE, seed=7),
        "mixtral": write_moe_gguf(d / "mix.gguf", MIXTRAL, seed=2),
    }


def _run(path, layer: dict | None, record: list | None = None):
    g = open_gguf(path)
    if layer is None:
        model = build_model(g)
    else:
        model = load_model(g, plan_model(g, resolve([("t", layer)]), 64, MEMORY))
    if record is not None:
        for blk in moe_blocks(model):
            route = blk.route

            def logged(x, route=route, layer=blk.layer):
                w, ids = route(x)
                record.append((layer, x.reshape(-1, x.shape[-1]).clone(), ids.clone()))
                return w, ids

            blk.route = logged
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    tokens = list(gen.stream(PROMPT, PARAMS))
    logits = gen.score(PROMPT + tokens)
    for s in getattr(model, "expert_sources", ()):
        if isinstance(s, StreamedExperts):
            s.close()  # in-flight read-aheads finish and are counted
    return tokens, logits, model


MODES = [
    {"prefetch": p, "evict": ev, "slots": n}
    for p, ev, n in itertools.product((True, False), ("lru", "lfu"), (1, 2, 5))
]


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_every_streaming_mode_is_token_exact(family, files):
    want_tokens, want_logits, _ = _run(files[family], None)
    misses = {}
    for st in MODES:
        tokens, logits, model = _run(files[family], {"experts": "disk", "streaming": st})
        assert tokens == want_tokens, st
        assert torch.equal(logits, want_logits), st
        s = expert_stats(model.expert_sources)
        streamed = next(x for x in model.expert_sources if isinstance(x, StreamedExperts))
        assert (streamed.n_slots, streamed.evict) == (st["slots"], st["evict"])
        assert s.bytes_read == (s.misses + s.prefetched) * streamed.slot_bytes, st
        if st["prefetch"]:
            assert s.guessed > 0 and 0 <= s.guessed_right <= s.guessed, st
        else:
            assert (s.prefetched, s.guessed, s.prefetch_hits) == (0, 0, 0), st
        misses[st["evict"], st["slots"], st["prefetch"]] = s.misses
    # slots matter: 5 slots miss less than 1 (all slots, every policy)
    assert all(misses[ev, 5, p] < misses[ev, 1, p] for ev in ("lru", "lfu") for p in (True, False))


def test_guess_counters_match_the_next_routers_top_k(files):
    """Decode steps (one token): the guess for layer l+1 is the top-k of layer l+1's router
    logits (plain torch on the GGUF's router weights) over layer l's FFN input."""
    path = files["qwen3moe"]
    routers = {
        i: torch.from_numpy(t.data.copy()).float()
        for t in gguf.GGUFReader(path).tensors
        for i in range(THREE.n_layers)
        if t.name == f"blk.{i}.ffn_gate_inp.weight"
    }
    record: list = []
    layer = {"experts": "disk", "streaming": {"slots": 6, "prefetch": True}}
    _, _, model = _run(path, layer, record)
    guessed = right = 0
    for (lay, x, _), (nxt, _, ids) in itertools.pairwise(record):
        if nxt != lay + 1 or x.shape[0] != 1:
            continue  # a guess spans two layers of one step; prefill guesses are by count
        guess = set(torch.topk(x.float() @ routers[nxt].T, THREE.n_used).indices[0].tolist())
        guessed += len(guess)
        right += len(guess & set(ids.reshape(-1).tolist()))
    # multi-token forwards guess at most k per layer too, counted apart
    pairs = itertools.pairwise(record)
    prefill = sum(THREE.n_used for (a, x, _), (b, _, _) in pairs if b == a + 1 and x.shape[0] > 1)
    s = expert_stats(model.expert_sources)
    assert guessed > 0 and prefill > 0
    assert guessed <= s.guessed <= guessed + prefill
    assert right <= s.guessed_right <= right + prefill
    # the guess beats chance (k of 16 experts) on this model: measured, not assumed
    assert right / guessed > THREE.n_used / THREE.n_expert


def test_evict_and_prefetch_settings(tmp_path):
    def parse(*flags):
        return build_parser().parse_args(["run", "-m", "x.gguf", *flags, "hi"])

    cfg = residency_config(parse("--expert-evict", "lfu", "--expert-prefetch", "off"), env={})
    assert (cfg.streaming.evict, cfg.streaming.prefetch) == ("lfu", False)
    env = {"LOCALLLM_EXPERT_EVICT": "lfu", "LOCALLLM_EXPERT_PREFETCH": "0"}
    cfg = residency_config(parse("--expert-evict", "lru"), env=env)
    assert (cfg.streaming.evict, cfg.streaming.prefetch) == ("lru", False)
    assert resolve([]).streaming.evict == "lru"  # the default
    doc = tmp_path / "r.toml"
    doc.write_text('[streaming]\nevict = "random"\n')
    with pytest.raises(ResidencyError, match="evict must be one of lru, lfu"):
        load_document(doc)
    with pytest.raises(ResidencyError, match="LOCALLLM_EXPERT_PREFETCH must be 1 or 0"):
        residency_config(parse(), env={"LOCALLLM_EXPERT_PREFETCH": "sometimes"})


def test_reads_setting_flag_environment_document(tmp_path):
    """Who asks for a streamed expert's read: the flag over the environment over the document."""

    def parse(*flags):
        return build_parser().parse_args(["bench", "-m", "x.gguf", *flags])

    doc = tmp_path / "r.toml"
    doc.write_text('[streaming]\nreads = "gpu"\n')
    assert resolve([]).streaming.reads == "auto"
    assert residency_config(parse("--residency", str(doc)), env={}).streaming.reads == "gpu"
    env = {"LOCALLLM_EXPERT_READS": "host"}
    assert residency_config(parse("--residency", str(doc)), env=env).streaming.reads == "host"
    cfg = residency_config(parse("--residency", str(doc), "--expert-reads", "auto"), env=env)
    assert cfg.streaming.reads == "auto"
    doc.write_text('[streaming]\nreads = "cpu"\n')
    with pytest.raises(ResidencyError, match="reads must be one of auto, gpu, host"):
        load_document(doc)
    with pytest.raises(ResidencyError, match="reads must be one of"):
        residency_config(parse(), env={"LOCALLLM_EXPERT_READS": "disk"})


def test_show_plan_names_the_eviction_and_prefetch_default(files):
    """Read-ahead unset: off, with a GPU too (measured slower on both); asked for: on."""
    g = open_gguf(files["qwen3moe"])
    gpu = MemoryInfo("cuda:0", host_free=1 << 30, device_free=1 << 30)
    for memory, st, want in (
        (MEMORY, {}, "prefetch off, evict lfu"),
        (gpu, {}, "prefetch off, evict lfu"),
        (gpu, {"prefetch": True}, "prefetch on, evict lfu"),
        (MEMORY, {"prefetch": True}, "prefetch on, evict lfu"),
        (gpu, {"prefetch": False}, "prefetch off, evict lfu"),
    ):
        cfg = resolve([("t", {"experts": "disk", "streaming": {"slots": 4, "evict": "lfu", **st}})])
        plan = plan_model(g, cfg, 64, memory)
        assert plan.streaming.prefetch == want.startswith("prefetch on")
        text = plan.describe()
        assert "expert slots 4 x" in text and want in text, (memory, st)
    assert resolve([]).streaming.prefetch is None  # unset until a plan resolves it
