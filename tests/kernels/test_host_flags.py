"""The GPU's side of a split layer's hand-over (`kernels.host_flags`): `hand_out` stores the token
rows and the CPU's routing into host buffers, then the step's number into the layer's flag;
`take_back` returns the GPU's sum plus the CPU's once the CPU's flag holds the number (counting
whether it had to wait), or gives up after its limit and says so. On CUDA the buffers and flags
are mapped host memory and the host sets them while the kernel spins; under TRITON_INTERPRET=1
they are CPU tensors."""

import time

import pytest
import torch

from tests.triton_env import CUDA, DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


def _mapped(**specs):
    """{name: (device view, host view)} of zeroed buffers the GPU reads and writes in place."""
    if not CUDA:
        out = {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in specs.items()}
        return {k: (v, v) for k, v in out.items()}
    from localllm.offload.mapped import host_view, map_empty

    out = map_empty(specs, DEVICE)
    for v in out.values():
        host_view(v).zero_()
    return {k: (v, host_view(v)) for k, v in out.items()}


def _sync():
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("t, dim, xdtype", [(1, 2048, torch.float32), (3, 1100, torch.bfloat16)])
def test_hand_out_stores_the_rows_and_the_cpus_routing_then_the_flag(t, dim, xdtype):
    from localllm.kernels import host_flags

    k, g = 8, 3
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, dim, generator=gen).to(xdtype)
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    ids = torch.stack([torch.randperm(128, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    f32 = torch.float32
    m = _mapped(rows=((8, dim), f32), w=((8, k - g), f32), ids=((8, k - g), torch.int64),
                flags=((3,), torch.int32))  # fmt: skip
    seq = torch.tensor([41], dtype=torch.int32, device=DEVICE)
    out = (m["rows"][0][:t], m["w"][0][:t], m["ids"][0][:t])
    dev = [v.to(DEVICE) for v in (x, w, ids)]
    host_flags.hand_out(*dev, g, out, m["flags"][0], 1, seq)
    _sync()
    assert m["flags"][1].tolist() == [0, 41, 0]
    assert torch.equal(m["rows"][1][:t], x.float()) and not m["rows"][1][t:].any()
    assert torch.equal(m["w"][1][:t], w[:, g:]) and torch.equal(m["ids"][1][:t], ids[:, g:].long())


def test_take_back_adds_the_cpus_sum_once_its_flag_holds_the_number():
    from localllm.kernels import host_flags

    m = _mapped(y=((3, 2500), torch.float32), flags=((2,), torch.int32), err=((1,), torch.int32))
    y = torch.randn(3, 2500)
    m["y"][1].copy_(y)
    m["flags"][1][1] = 7
    yg = torch.randn(3, 2500, device=DEVICE)
    seq = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    waits = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    got = host_flags.take_back(yg, m["y"][0], m["flags"][0], 1, seq, waits, m["err"][0], limit=4)
    _sync()
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), yg.cpu() + y)
    assert waits.tolist() == [0, 0] and m["err"][1].tolist() == [0]


def test_take_back_gives_up_after_its_limit_and_says_so():
    from localllm.kernels import host_flags

    m = _mapped(y=((1, 16), torch.float32), flags=((2,), torch.int32), err=((1,), torch.int32))
    seq = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    waits = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    yg = torch.zeros(1, 16, device=DEVICE)
    host_flags.take_back(yg, m["y"][0], m["flags"][0], 0, seq, waits, m["err"][0], limit=16)
    _sync()
    assert waits.tolist() == [1, 0] and m["err"][1].tolist() == [1]


@pytest.mark.skipif(not CUDA, reason="the host sets the flag while the kernel spins: CUDA")
def test_take_back_holds_the_stream_and_reads_what_the_host_wrote_before_its_flag():
    from localllm.kernels import host_flags

    m = _mapped(y=((2, 4096), torch.float32), flags=((2,), torch.int32), err=((1,), torch.int32))
    seq = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    waits = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    yg = torch.ones(2, 4096, device=DEVICE)
    got = host_flags.take_back(yg, m["y"][0], m["flags"][0], 1, seq, waits, m["err"][0])
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    assert not done.query()  # still spinning: the flag does not hold 9
    m["y"][1].fill_(2.0)  # written after the kernel started, before the flag: it must be seen
    m["flags"][1][1] = 9
    done.synchronize()
    assert torch.equal(got.cpu(), torch.full((2, 4096), 3.0))
    assert waits.tolist() == [0, 1] and m["err"][1].tolist() == [0]
