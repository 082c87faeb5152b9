"""`kernels.cpu.onednn_fp32`: float32 CPU matmuls through oneDNN only where its probe shows
float32 math; the setting restored after the block; a probe that sees bfloat16-sized errors
keeps MKL."""

import torch
import torch.nn.functional as F

from localllm.kernels.cpu import onednn_fp32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_fast_fp32_keeps_float32_accuracy_and_restores_the_setting():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(300, 768, generator=g), torch.randn(1000, 768, generator=g)
    exact = x.double() @ w.double().t()
    before = torch.backends.mkldnn.matmul.fp32_precision
    with onednn_fp32.fast_fp32():
        inside = torch.backends.mkldnn.matmul.fp32_precision
        got = F.linear(x, w)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    assert inside == ("bf16" if onednn_fp32.fp32_through_onednn() else before)
    assert got.dtype == torch.float32
    assert _rel(got, exact) < 2e-6  # float32 sums; bfloat16 math would be ~4e-3


def test_a_probe_that_sees_bfloat16_math_keeps_mkl(monkeypatch):
    real = F.linear

    def bf16_math(a, w, b=None):  # what a CPU with AMX-BF16 may do under the setting
        if torch.backends.mkldnn.matmul.fp32_precision == "bf16":
            return real(a.bfloat16(), w.bfloat16(), b).float()
        return real(a, w, b)

    monkeypatch.setattr(F, "linear", bf16_math)
    onednn_fp32.fp32_through_onednn.cache_clear()
    try:
        assert not onednn_fp32.fp32_through_onednn()
        with onednn_fp32.fast_fp32():
            assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"
    finally:
        onednn_fp32.fp32_through_onednn.cache_clear()


def test_blocks_in_threads_restore_the_setting_when_the_last_ends():
    import threading

    before = torch.backends.mkldnn.matmul.fp32_precision
    go, done = threading.Barrier(4), []

    def work():
        with onednn_fp32.fast_fp32():
            go.wait()  # all four inside at once
            F.linear(torch.randn(8, 768), torch.randn(16, 768))
        done.append(True)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == 4 and torch.backends.mkldnn.matmul.fp32_precision == before
