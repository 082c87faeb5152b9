"""The host side of a split decode step captured as one graph (`engine.moe.split_link`), on the CPU:
a thread plays the GPU (it signals each layer's rows and waits for the CPU's flag, as the
captured kernels do), the native flag calls carry the hand-over. The CUDA graph itself is tested
in tests/offload/test_gpu_residency.py."""

import ctypes
import threading
import time

import pytest
import torch

from localllm.engine.moe import split_link
from localllm.engine.moe.split import SplitExperts
from localllm.engine.moe.split_link import SplitLink, SplitLinkError
from localllm.kernels.quant import QuantType
from tests.offload.native_layers import TYPES as QTYPES
from tests.offload.native_layers import native_kernels, random_layer

TYPES = tuple(QuantType(t) for t in QTYPES)
DIM, HIDDEN, K = 256, 512, 8


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return native_kernels(tmp_path_factory)


def _blocks(seed):
    return random_layer(12, DIM, HIDDEN, seed)


def _flag(t: torch.Tensor, i: int) -> int:
    return t.data_ptr() + 4 * i


def test_flag_wait_sees_another_threads_store_and_gives_up_after_its_timeout(kernels):
    lib, flag = kernels.lib, torch.zeros(2, dtype=torch.int32)
    setter = threading.Timer(0.05, lambda: lib.flag_set(_flag(flag, 1), 7))
    setter.start()
    t0 = time.perf_counter()
    assert lib.flag_wait(_flag(flag, 1), 7, 10_000_000) == 0
    assert time.perf_counter() - t0 >= 0.04 and flag.tolist() == [0, 7]
    t0 = time.perf_counter()
    assert lib.flag_wait(_flag(flag, 0), 7, 30_000) == -1
    assert 0.025 < time.perf_counter() - t0 < 5
    assert lib.flag_wait(_flag(flag, 1), 7, 0) == 0  # already there: at once


def _captured(kernels, layers=2, tokens=1):
    """`layers` split layers "captured" into a CPU link, with their inputs and expected CPU
    shares (the native kernels over the last c pairs of each token)."""
    link = SplitLink(kernels, layers, torch.device("cpu"))
    gen = torch.Generator().manual_seed(tokens)
    want = []
    for layer in range(layers):
        g, u, d = _blocks(layer)
        split = SplitExperts(kernels, (g, u, d), TYPES, "silu", DIM, K, layer=layer)
        x = torch.randn(tokens, DIM, generator=gen)
        ids = torch.stack([torch.randperm(12, generator=gen)[:K] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, K, generator=gen), -1)
        split.ffn(x, None, w, ids, lambda x, xq, w, i: torch.zeros_like(x), link=link)
        c = split.cpu
        want.append(kernels.moe_ffn(x, w[:, K - c :], ids[:, K - c :], g, u, d, TYPES, "silu"))
    return link, want


def _gpu(link, got, order, limit_us=10_000_000):
    """The GPU's side of one replay: per layer its rows' flag, then the wait for the CPU's."""
    lib, gpu, cpu = link.native.lib, link.flags["gpu"], link.flags["cpu"]
    for i, (split, t) in enumerate(link.jobs):
        lib.flag_set(_flag(gpu, i), link.seq)
        ok = lib.flag_wait(_flag(cpu, i), link.seq, limit_us) == 0
        order.append((i, ok))
        got.append(split._y[:t].clone())


@pytest.mark.parametrize("tokens", [1, 3])
def test_each_layers_cpu_share_runs_when_its_rows_are_signalled(kernels, tokens):
    link, want = _captured(kernels, 3, tokens)
    assert [t for _, t in link.jobs] == [tokens] * 3
    for replay in range(2):  # a second replay: a new number, the old flags match nothing
        link.arm()
        assert link.seq == replay + 1 and link.seq_dev.tolist() == [link.seq]
        got, order = [], []
        gpu = threading.Thread(target=_gpu, args=(link, got, order))
        gpu.start()
        link.run()
        gpu.join(10)
        assert order == [(0, True), (1, True), (2, True)]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    split = link.jobs[0][0]
    assert split.timing.steps == 2 and split.host_rows == 2 * tokens
    assert split.timing.wait_seconds > 0 and split.timing.cpu_seconds > 0


def test_a_bad_expert_id_fails_its_layer_and_releases_every_wait_of_the_gpu(kernels):
    link, want = _captured(kernels, 3)
    link.jobs[1][0]._ids[0, 0] = 12  # the layer has 12 experts: 0..11
    link.arm()
    got, order = [], []
    gpu = threading.Thread(target=_gpu, args=(link, got, order))
    gpu.start()
    with pytest.raises(SplitLinkError, match="split layer 1: an expert id out of range"):
        link.run()
    gpu.join(10)
    assert not gpu.is_alive() and order == [(0, True), (1, True), (2, True)]
    assert torch.equal(got[0], want[0])  # the layer before it ran
    assert [s.timing.steps for s, _ in link.jobs] == [1, 0, 0]


def test_rows_that_never_come_time_out_and_release_the_gpu(kernels, monkeypatch):
    monkeypatch.setattr(split_link, "HOST_TIMEOUT_US", 20_000)
    link, _ = _captured(kernels, 2)
    link.arm()
    with pytest.raises(SplitLinkError, match="layer 0: the GPU's rows never came"):
        link.run()
    assert link.flags["cpu"].tolist() == [link.seq] * 2  # no wait of the GPU is left hanging


def test_a_gpu_that_gave_up_is_raised_before_the_next_replay(kernels):
    link, _ = _captured(kernels, 1)
    link.arm()
    ctypes.c_int32.from_address(link.flags["err"].data_ptr()).value = 1  # as the GPU's wait does
    with pytest.raises(SplitLinkError, match="gave up waiting"):
        link.arm()
    link.arm()  # raised once: the next step runs
    link.release()  # a replay whose host side will not run: no wait of the GPU is left
    assert link.flags["cpu"].tolist() == [link.seq]


def test_more_layers_than_planned_is_an_error(kernels):
    link, _ = _captured(kernels, 1)
    with pytest.raises(SplitLinkError, match="more split layers than the 1 planned"):
        x, w, ids = torch.zeros(1, DIM), torch.ones(1, K) / K, torch.arange(K)[None]
        link.hand_out(link.jobs[0][0], x, w, ids, K - link.jobs[0][0].cpu)


def test_more_pairs_than_the_native_loop_holds_is_refused_at_layout(kernels):
    from localllm.kernels.cpu.split_run import MAX_PAIRS, SplitRun, SplitSpec

    link, _ = _captured(kernels, 1)
    split = link.jobs[0][0]
    rows = MAX_PAIRS // split.cpu + 1
    with pytest.raises(ValueError, match=f"in a split layer: at most {MAX_PAIRS}"):
        SplitRun(kernels, [SplitSpec(split.call, rows, 0, 0, 0, 0, 0, 0)])


def test_split_balance_sums_the_layers_and_says_which_side_waited(kernels):
    from types import SimpleNamespace

    from localllm.engine.moe.split_link import SplitBalance, split_balance

    link, _ = _captured(kernels, 2)
    blocks = [SimpleNamespace(split=s) for s, _ in link.jobs] + [SimpleNamespace(split=None)]
    before = split_balance(blocks, [link])
    assert before.steps == 0 and before.cpu_experts == (5, 5) and before.n_used == K
    link.waits[1] = 3  # as the GPU's wait kernel counts
    link.arm()
    gpu = threading.Thread(target=_gpu, args=(link, [], []))
    gpu.start()
    link.run()
    gpu.join(10)
    got = split_balance(blocks, [link]).minus(before)
    assert got.steps == 2 and got.gpu_waits == 3 and got.cpu_s > 0 and got.wait_s > 0
    assert split_balance(blocks[2:], [link]) is None
    line = SplitBalance((5, 5, 4), 8, 300, 0.03, 0.06, 75).line()
    assert line.startswith("the CPU computed 4-5 of each token's 8 experts in 3 layers; ")
    assert "waited 100 us for the rows and computed 200 us" in line
    assert "the GPU waited for the CPU in 25% of them" in line
