"""`kernels.launch.FastKernel` against the JIT it bypasses: the same results for arguments that
Triton specializes differently (a pointer off 16-byte alignment, integers equal to 1, divisible
by 16 or neither, constexpr values), one compiled kernel kept per specialization, repeats served
from it. On CUDA (marked `gpu`); under TRITON_INTERPRET=1 it passes every call to the JIT."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (CUDA or INTERPRET), reason="needs a CUDA device (or TRITON_INTERPRET=1 with triton)"
    ),
]


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def axpb(x_ptr, y_ptr, n, a, b, B: tl.constexpr, TWICE: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        v = tl.load(x_ptr + i, mask=i < n) * a + b
        if TWICE:
            v = v * 2
        tl.store(y_ptr + i, v, mask=i < n)

    return axpb


def test_fast_launches_equal_the_jit_per_specialization():
    from localllm.kernels.launch import FastKernel

    fk = FastKernel(_kernel())
    base = torch.arange(80, dtype=torch.float32, device=DEVICE)
    cases = [
        (base, 64, 16, False),  # aligned, n divisible by 16, b divisible by 16
        (base[1:], 64, 16, False),  # the pointer 4 bytes off alignment
        (base, 37, 1, False),  # n odd, b == 1 (Triton folds 1 into the kernel)
        (base, 37, 5, True),  # another constexpr
        (base[3:], 50, 17, True),
    ]
    for x, n, b, twice in cases * 2:  # the second round is served from the cache
        y = torch.full_like(base, -1.0)[: x.numel()]
        fk[(4,)](x, y, n, 0.5, b, B=32, TWICE=twice)
        want = (x[:n] * 0.5 + b) * (2 if twice else 1)
        assert torch.equal(y[:n], want), (n, b, twice)
        assert torch.all(y[n:] == -1.0)
    if fk.fast:
        # five distinct specializations, each compiled once; repeats added none
        assert len(fk.compiled) == 5


def test_keys_separate_what_triton_specializes():
    from localllm.kernels.launch import _spec

    base = torch.zeros(8, device=DEVICE)
    assert _spec(base) != _spec(base[1:])  # 16-byte aligned or not
    assert _spec(base) != _spec(base.half())
    ints = [1, 16, 17, 2**40, 2**63]
    assert len({_spec(v) for v in ints}) == len(ints)
    assert _spec(32) == _spec(48) and _spec(3) == _spec(-5)  # the same class: one kernel
    assert _spec(True) != _spec(1) and _spec(1.0) != _spec(1)
    assert _spec(None) is None and _spec((1, 2)) is None  # the JIT decides those
