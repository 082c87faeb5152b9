"""Drawn MoE routing for measurements (`bench --routing`, `engine.moe.routing_override`).

On a tiny random qwen3moe GGUF: uniform draws spread tokens evenly over the experts (a chi-square
bound far above chance and far below the router's own skew), zipf:1 follows its ranking, a trace
is replayed id for id and wraps, every draw names k distinct experts, `model` restores the router.
Then `localllm bench` with the flags (two routings, one load), and their one-line errors.
"""

import subprocess
import sys

import numpy as np
import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import MoEFeedForward
from localllm.engine.moe.routing_override import RoutingSpec, override_routing, parse_routing
from localllm.engine.runtime.kv_cache import PagedKVCache
from tests.offload.tiny_moe import MoESpec, write_moe_gguf

SPEC = MoESpec(n_expert=16, n_used=2)
N = 512  # tokens per forward


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("route") / "moe.gguf", SPEC)


@pytest.fixture(scope="module")
def model(path):
    g = open_gguf(path)
    m = build_model(g, precise=True)
    yield m
    g.close()


def routed_ids(model, seed: int = 0) -> dict[int, torch.Tensor]:
    """Expert ids [N, k] each MoE layer used for N random tokens (one prompt)."""
    seen = {}
    blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    hooks = []
    for b in blocks:

        def route(x, b=b, inner=b.route):
            w, ids = inner(x)
            seen[b.layer] = ids.clone()
            return w, ids

        b.route = route
        hooks.append(b)
    ids = torch.randint(0, SPEC.vocab, (N,), generator=torch.Generator().manual_seed(seed))
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, N // 4, 4, kvh, hd, dtype="f32")
    with torch.inference_mode():
        model(ids, torch.arange(N), BatchMeta.contiguous(N, N, 4), kv)
    for b in hooks:
        del b.route  # back to the class's method
    return seen


def chi2(ids: torch.Tensor) -> float:
    counts = torch.bincount(ids.reshape(-1), minlength=SPEC.n_expert).double()
    expected = counts.sum() / SPEC.n_expert
    return float(((counts - expected) ** 2 / expected).sum())


def test_parse_forms_and_errors():
    assert parse_routing("model") == RoutingSpec("model")
    assert parse_routing("zipf:1.5").zipf_s == 1.5 and parse_routing("zipf").zipf_s == 1.0
    assert parse_routing("trace:/x.npy").trace.name == "x.npy"
    for bad in ("uniform:2", "zipf:x", "zipf:-1", "trace:", "random"):
        with pytest.raises(ValueError, match="--routing"):
            parse_routing(bad)


def test_uniform_is_balanced_and_distinct_and_model_restores(model):
    own = routed_ids(model)
    assert override_routing(model, parse_routing("uniform"), "cpu") == SPEC.n_layers
    drawn = routed_ids(model)
    override_routing(model, parse_routing("model"), "cpu")
    again = routed_ids(model)
    for layer, ids in drawn.items():
        assert ids.shape == (N, SPEC.n_used)
        assert (ids[:, 0] != ids[:, 1]).all()  # k distinct experts per token
        # 15 degrees of freedom: chance exceeds 50 once in ~10^5 draws
        assert chi2(ids) < 50, chi2(ids)
        assert torch.equal(again[layer], own[layer])  # the router's own choice is back
    assert max(chi2(ids) for ids in own.values()) > 100  # the random-weight router is skewed


def test_zipf_follows_its_ranking(model):
    override_routing(model, parse_routing("zipf:1"), "cpu")
    override = next(m for m in model.modules() if isinstance(m, MoEFeedForward)).routing_override
    drawn = routed_ids(model)
    override_routing(model, parse_routing("model"), "cpu")
    for layer, ids in drawn.items():
        counts = torch.bincount(ids.reshape(-1), minlength=SPEC.n_expert)
        by_rank = counts[override.log_p[layer].argsort(descending=True)]
        # the most popular experts take far more than the least (1/r: rank 1 vs ranks 13-16)
        assert by_rank[:2].sum() > 2 * by_rank[-4:].sum(), by_rank.tolist()


def test_trace_replays_and_wraps(model, tmp_path):
    rng = np.random.default_rng(0)
    trace = np.stack([rng.permutation(SPEC.n_expert)[: SPEC.n_used] for _ in range(300 * 2)])
    trace = trace.reshape(300, SPEC.n_layers, SPEC.n_used)
    f = tmp_path / "trace.npy"
    np.save(f, trace)
    override_routing(model, parse_routing(f"trace:{f}"), "cpu")
    drawn = routed_ids(model)
    override_routing(model, parse_routing("model"), "cpu")
    rows = np.arange(N) % 300
    for layer, ids in drawn.items():
        assert np.array_equal(ids.numpy(), trace[rows, layer])
    np.save(tmp_path / "bad.npy", trace[:, :1])
    with pytest.raises(ValueError, match=r"shape \(300, 1, 2\), this model needs"):
        override_routing(model, parse_routing(f"trace:{tmp_path / 'bad.npy'}"), "cpu")


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "localllm.app", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_bench_flags(path):
    out = bench("-m", str(path), "-p", "0", "-n", "4", "-r", "1", "--routing", "zipf:1,model",
                "--decode-feed", "argmax", "-t", "1")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [ln for ln in out.stdout.splitlines() if "| qwen3moe" in ln]
    assert len(rows) == 2 and "tg4 (zipf:1) |" in rows[0] and " tg4 |" in rows[1], rows
    assert "routing: zipf:1,model; decode steps fed: argmax" in out.stdout
    bad = bench("-m", str(path), "--routing", "zipf:x")
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "--routing zipf:S needs S between 0 and 10" in bad.stderr
