"""No host step inside a prompt CUDA graph's captured region, checked on the CPU.

`capture_guard.HostOps` records what a capture cannot hold (tensors made from host data, values
read to the host, data-dependent shapes) while `PrefillGraphs.forward` runs as it is captured: on
its static inputs and context, after an unrecorded warm-up, with every tensor answering
`is_cuda` so the GPU branches run (their Triton kernels under TRITON_INTERPRET=1). Every model
that `prefill_graphs.declined` lets through (hybrids with STATEFUL on) must record nothing: a
tiny llama (the transformer path that captures on an H100: the guard's calibration), tiny
lfm2 and granitehybrid (dense; token-by-token and chunked scans) at head dims the device-context
attention takes, and the converted hybrid fixtures (head dim 8: their attention reads the context
on the host, so `declined` must turn them away; it let them through before, and their captures
failed on the H100 with "Cannot copy between CPU and CUDA tensors during CUDA graph capture").
"""

import dataclasses

import pytest
import torch

from localllm.engine.gguf import open_gguf
from localllm.engine.layers import recurrent
from localllm.engine.loader import build_model
from localllm.engine.runtime import prefill_graphs
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.prefill_graphs import PrefillGraphs, bucket_of, declined
from localllm.engine.runtime.recurrent_state import attach_states
from tests.engine.capture_guard import HostOps
from tests.engine.family_goldens import path
from tests.engine.tiny_hybrids import write_tiny_hybrid
from tests.triton_env import INTERPRET

BS, NB = 16, 12
TABLE = [7, 2, 9, 0, 4, 8]
# (first position, tokens): a fresh prompt on a bucket, then a chunk after it, padded
CHUNKS = [(0, 32), (32, 40)]
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 with triton")


def test_the_guard_records_host_steps_and_nothing_else():
    x = torch.arange(6.0)
    steps = {
        "tensor from host data": lambda: torch.tensor([1, 2]),
        "value read": lambda: x.sum().item(),
        "bool of a tensor": lambda: bool(x[0] > 0),
        "tolist": lambda: x.tolist(),
        "cpu": lambda: x.cpu(),
        "device move": lambda: x.to("cpu"),
        "nonzero": lambda: x.nonzero(),
        "boolean index": lambda: x[x > 2],
        "repeat_interleave without its size": lambda: torch.repeat_interleave(x.long()),
    }
    for what, step in steps.items():
        with HostOps() as h:
            step()
        assert h.found, what
    with HostOps() as h:  # device work only: what a capture holds
        n = torch.zeros((), dtype=torch.long) + 3
        i = torch.arange(6)
        y = torch.where(i < n, x, torch.zeros((), dtype=x.dtype)).index_select(0, i)
        torch.repeat_interleave(i, i, output_size=15)
        torch.stack([n, torch.full_like(n, 6)]).to(torch.int32)
        y.float().contiguous()
    assert h.found == [], h.found


def _tiny_llama(root):
    from tests.perf.make_synthetic import SHAPES, write_synthetic

    p = root / "tiny.gguf"
    write_synthetic(p, dataclasses.replace(SHAPES["tiny"], vocab=512), "Q4_K_M", None, seed=2)
    return p


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("host_ops")
    return {
        "tiny": _tiny_llama(root),
        "tiny-lfm2": write_tiny_hybrid(root, "tiny-lfm2"),
        "tiny-granitehybrid_dense": write_tiny_hybrid(root, "tiny-granitehybrid_dense"),
        "lfm2": path("lfm2"),
        "granitehybrid_dense": path("granitehybrid_dense"),
    }


def _captured_host_steps(gguf_path) -> tuple[str | None, list]:
    """(`declined` for the model over an f16 cache, what each chunk's captured forward
    recorded)."""
    with open_gguf(str(gguf_path)) as gg, torch.inference_mode():
        model = build_model(gg, device="cpu")
        layers, kvh, hd = model.kv_shape()
        kv = PagedKVCache(layers, NB, BS, kvh, hd, "f16", "cpu", model.kv_value_dim())
        for t in kv.k + kv.v:
            t.zero_()
        attach_states(kv, model, 4)
        prompts = PrefillGraphs(model, kv, (NB - 1) * BS, max_blocks=8)
        found = []
        g = torch.Generator().manual_seed(0)
        for start, n in CHUNKS:
            ids = torch.randint(0, model.args.vocab_size, (n,), generator=g)
            slots = torch.tensor([TABLE[q // BS] * BS + q % BS for q in range(start, start + n)])
            inputs = torch.zeros(3, bucket_of(n), dtype=torch.long)
            prompts.fill(inputs, ids, slots, start, TABLE, 2)
            with HostOps(cuda_like=True, recording=False) as h:
                prompts.forward(inputs)  # the warm-up before a capture
                h.recording = True
                prompts.forward(inputs)  # what the capture holds
            found += h.found
        return declined(model, kv), found


@interpret
@pytest.mark.parametrize(
    "name, scan",
    [("tiny", None), ("tiny-lfm2", "token"), ("tiny-granitehybrid_dense", "token"),
     ("tiny-granitehybrid_dense", "chunked")],
)  # fmt: skip
def test_a_taken_prompt_graph_holds_no_host_step(models, name, scan, monkeypatch):
    monkeypatch.setattr(prefill_graphs, "STATEFUL", True)
    if scan == "chunked":
        from localllm.kernels.recurrent import triton_ssd_chunked

        monkeypatch.setattr(recurrent, "CHUNKED_MIN_ROWS", 32)
        monkeypatch.setattr(triton_ssd_chunked, "CHUNK", 16)
    why, found = _captured_host_steps(models[name])
    assert why is None, why  # taken: so the guard is what decides
    assert found == [], found


@interpret
@pytest.mark.parametrize("name", ["lfm2", "granitehybrid_dense"])
def test_fixtures_whose_attention_reads_the_host_are_declined(models, name, monkeypatch):
    monkeypatch.setattr(prefill_graphs, "STATEFUL", True)
    why, found = _captured_host_steps(models[name])
    # head dim 8: context_attention's host path (ctx.tolist(), host tables) in the forward
    assert any("tolist" in op for op, _ in found), found
    assert why is not None and "head dims 8 / 8" in why, why
