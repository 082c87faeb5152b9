"""Decode graphs captured in pieces around host steps (`engine.runtime.graph_breaks`).

On CPU: an MoE block that needs the host, told it is being captured, hands its work from the
routing on to a host step and returns a static output; running the step gives exactly the eager
forward (resident, streamed with few slots, shared experts). On CUDA (marked `gpu`): a chain of
real graphs with a host step between them replays with fresh inputs each time.
"""

import pytest
import torch

from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.moe.block import moe_blocks
from localllm.engine.moe.residency import load_model, plan_model
from localllm.offload.memory import MemoryInfo
from localllm.offload.residency import resolve
from tests.engine.test_deepseek2 import write_deepseek2
from tests.offload.tiny_moe import write_moe_gguf

CPU = MemoryInfo("cpu", host_free=1 << 30)


class _Recorder:
    """Stands in for `HostBreaks` on CPU: keeps the host steps instead of capturing graphs."""

    def __init__(self):
        self.steps = []

    def host(self, step):
        self.steps.append(step)


@pytest.mark.parametrize(
    ("family", "layer"),
    [
        ("qwen3moe", None),
        ("qwen3moe", {"experts": "disk", "streaming": {"slots": 3, "prefetch": True}}),
        ("deepseek2", None),
    ],
)
def test_captured_moe_block_defers_to_its_host_step(tmp_path, family, layer):
    if family == "deepseek2":
        path = write_deepseek2(tmp_path / "ds.gguf", seed=4)
    else:
        path = write_moe_gguf(tmp_path / "q.gguf")
    g = open_gguf(path)
    try:
        if layer is None:
            model = build_model(g)
        else:
            model = load_model(g, plan_model(g, resolve([("t", layer)]), 64, CPU))
        gen = torch.Generator().manual_seed(0)
        for blk in moe_blocks(model):
            x = torch.randn(3, blk.dim, generator=gen)
            with torch.inference_mode():
                want = blk(x)
                lookups = blk.source.stats.lookups
                rec = _Recorder()
                blk.breaks = rec
                try:
                    out = blk(x)
                finally:
                    blk.breaks = None
                assert len(rec.steps) == 1
                # nothing of the expert work ran yet: the step does it, at every replay
                assert blk.source.stats.lookups == lookups
                for _ in range(2):
                    out.zero_()
                    rec.steps[0]()
                    torch.testing.assert_close(out, want, rtol=0, atol=0)
                assert blk.source.stats.lookups > lookups
    finally:
        g.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chain_replays_graphs_and_host_steps_in_order():
    from localllm.engine.runtime.graph_breaks import HostBreaks

    x = torch.zeros(4, device="cuda")
    chain = HostBreaks()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    seen = []
    with torch.cuda.stream(side):
        chain.begin()
        a = x * 2  # graph 0
        b = torch.zeros_like(a)  # static: the host step writes it, graph 1 reads it

        def step():
            host = a.cpu()
            seen.append(host.clone())
            b.copy_(host + 1)

        chain.host(step)
        c = b * 3  # graph 1
        chain.end()
    torch.cuda.current_stream().wait_stream(side)
    assert len(chain) == 2 and not seen  # capture runs no step
    for v in (1.0, 5.0, -2.0):
        x.fill_(v)
        chain.replay()
        torch.cuda.synchronize()
        assert seen[-1].tolist() == [2 * v] * 4
        assert c.cpu().tolist() == [3 * (2 * v + 1)] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fork_lets_the_host_wait_for_the_first_graph_alone():
    """A fork's event is recorded between two graphs: the host step after the second graph
    waits on it and reads what the first graph copied to page-locked memory while the second
    graph (a long GEMM chain here) may still run; the third graph adds the host's result."""
    from localllm.engine.runtime.graph_breaks import HostBreaks

    x = torch.zeros(4, device="cuda")
    m = torch.randn(2048, 2048, device="cuda") / 64
    pinned_in = torch.zeros(4, pin_memory=True)
    pinned_out = torch.zeros(4, pin_memory=True)
    chain = HostBreaks()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain.begin()
        pinned_in.copy_(x * 2, non_blocking=True)  # graph 0
        ready = chain.fork()
        busy = m
        for _ in range(20):  # graph 1: work the host step does not wait for
            busy = busy @ m

        def step():
            ready.synchronize()
            pinned_out.copy_(pinned_in + 1)

        chain.host(step)
        y = pinned_out.to("cuda", non_blocking=True) + busy[0, :4] * 0  # graph 2
        chain.end()
    torch.cuda.current_stream().wait_stream(side)
    assert len(chain) == 3
    for v in (1.0, 5.0, -2.0):
        x.fill_(v)
        chain.replay()
        torch.cuda.synchronize()
        assert y.cpu().tolist() == [2 * v + 1] * 4
