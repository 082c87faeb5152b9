"""The LoRA shrink run by the kernel that makes a module's input (`engine.lora.delta`'s
"epilogue" scheme with PRODUCER_SHRINK): the RMSNorm kernel (plain and with the residual add,
and with a MoE layer's weighted rows) writes t = (y @ A.T) * W into the module's scratch from
extra programs, the SiLU product adds it from its column programs; their own outputs (stream,
norm, quantized twin) are unchanged bit for bit, t is within float32 rounding of the float64
product. At one module of the tiny Q8_0 llama (q|k|v after the norm, down after the SiLU
product): `tails` then launches no shrink, and the GEMV's output lands within float32 rounding
of the float64 truth, the scratch left at zero. Kernels: on CUDA (marked `gpu`) or under
TRITON_INTERPRET=1 with CPU tensors; the torch fallback of `kernels.fused.ops` runs anywhere."""

import pytest
import torch

from localllm.engine.lora import delta
from localllm.kernels.fused import ops
from localllm.kernels.fused.lora_delta import LoraShrink
from tests.lora.lora_refs import HF, LORA
from tests.triton_env import DEVICE, needs_triton

D, H, EPS = 256, 3072, 1e-5
REL_TOL = 1e-5  # of t's largest value: float32 dot products against the float64 product


def _shrink(r: int, k: int, rows: int, seed: int = 0, partial: int = 0) -> LoraShrink:
    """`partial` > 0: a partials buffer of that many a value (`delta.PARTIAL_SHRINK`), NaN
    before the call (what the kernel does not write stays NaN); the reports land in
    `_reports`."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, k, generator=g).half()
    w = torch.randn(64, r, generator=g)
    w[1] = 0.0  # a row on no adapter: exactly 0
    if partial:
        _reports.clear()
        t = torch.full((64, r, partial), float("nan"), device=DEVICE)
        return LoraShrink(a.to(DEVICE), w.to(DEVICE), t, partial, _reports.append)
    return LoraShrink(a.to(DEVICE), w.to(DEVICE), torch.zeros(64, r, device=DEVICE))


_reports: list[int] = []


def _same_twin(a, b) -> bool:
    """The quantized twins' buffers equal bit for bit."""
    return all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in ("words", "scale", "sum16", "xsum")
    )


def _check_t(sh: LoraShrink, y: torch.Tensor, rows: int, parts: int = 1) -> None:
    """t (with partials: the sum of the `parts` the kernel reported, each written, the rest
    and the rows past the call untouched) against the float64 product."""
    want = (y.double().cpu() @ sh.a.double().cpu().T) * sh.w[:rows].double().cpu()
    got = sh.t.double().cpu()
    if sh.ps:
        assert _reports == [parts]
        assert not got[:rows, :, :parts].isnan().any()  # every partial written
        assert got[:rows, :, parts:].isnan().all() and got[rows:].isnan().all()
        got = got[:rows, :, :parts].sum(-1)
    else:
        assert not got[rows:].any()  # rows past the call untouched
    scale = want.abs().max().item()
    assert scale > 1.0
    assert (got[:rows] - want).abs().max().item() < REL_TOL * scale
    if rows > 1:
        assert not got[1].any()


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("rank", [16, 22, 192])  # 192: q|k|v of four rank-16 adapters
@pytest.mark.parametrize("form", ["norm", "add", "weighted"])
@pytest.mark.parametrize("partial", [0, 64], ids=["scratch", "partials"])
def test_norm_kernel_runs_the_shrink(form, rank, rows, partial):
    """Into the scratch, or as partial 0 of a partials buffer (one program a value)."""
    from localllm.kernels.fused.triton_ops import add_rms_norm_cuda, rms_norm_cuda

    g = torch.Generator().manual_seed(rows * 100 + rank)
    x = torch.randn(rows, D, generator=g).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(D, generator=g)).to(DEVICE)
    k = 3 if form == "weighted" else 1
    r = torch.randn(rows * k, D, generator=g).to(DEVICE)
    rw = torch.rand(rows, k, generator=g).to(DEVICE) if form == "weighted" else None
    sh = _shrink(rank, D, rows, partial=partial)

    def run(shrink):
        if form == "norm":
            return (None, *rms_norm_cuda(x, nw, EPS, True, shrink))
        return add_rms_norm_cuda(x, r, nw, EPS, True, rw=rw, shrink=shrink)

    s0, y0, q0 = run(None)
    s1, y1, q1 = run(sh)
    assert torch.equal(y0, y1) and (s0 is None or torch.equal(s0, s1))
    assert _same_twin(q0, q1)
    _check_t(sh, y1, rows)


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("rank", [16, 44, 64])  # 64: down of four rank-16 adapters
@pytest.mark.parametrize(("rstep", "bh", "apf"), [(None, None, False), (8, None, False),
    (16, None, False), (None, 256, False), (8, 256, False), (None, None, True),
    (16, None, True), (8, 256, True)])  # fmt: skip
@pytest.mark.parametrize("partial", [0, 64, 4], ids=["scratch", "partials", "4-partials"])
def test_silu_kernel_adds_the_shrink(rank, rows, rstep, bh, apf, partial, monkeypatch):
    """Also with `SILU_LORA_RSTEP` splitting A's rows over more programs (44 in 16 + 16 + 12),
    and `SILU_LORA_BH` narrowing each program's columns (3,072 in 12 of 256): y and its twin are
    stored once, t gets every row. With partials each column block stores its own (12 of 256,
    or 3 of 1,024), and a buffer of 4 a value makes the blocks wider (3,072 in 3 of 1,024).
    `SILU_LORA_PREFETCH` (apf): the first rows of A loaded before the PDL wait, the same t."""
    from localllm.kernels.fused import triton_ops
    from localllm.kernels.fused.triton_ops import silu_mul_cuda

    monkeypatch.setattr(triton_ops, "SILU_LORA_RSTEP", rstep)
    monkeypatch.setattr(triton_ops, "SILU_LORA_BH", bh)
    monkeypatch.setattr(triton_ops, "SILU_LORA_PREFETCH", apf)
    g = torch.Generator().manual_seed(rows + rank)
    gu = torch.randn(rows, 2 * H, generator=g).to(DEVICE)
    sh = _shrink(rank, H, rows, seed=1, partial=partial)
    y0, q0 = silu_mul_cuda(gu, H, True)
    y1, q1 = silu_mul_cuda(gu, H, True, sh)
    assert torch.equal(y0, y1)
    assert _same_twin(q0, q1)
    _check_t(sh, y1, rows, parts=H // (bh or 1024) if partial == 64 else 3)


def test_the_torch_fallback_writes_the_same_product():
    """On CPU tensors `ops` runs the torch forms and the shrink's reference beside them."""
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)
    nw = torch.ones(D)
    for make in (
        lambda sh: ops.rms_norm_q(x, nw, EPS, shrink=sh)[0],
        lambda sh: ops.add_rms_norm_q(x, r, nw, EPS, shrink=sh)[1],
        lambda sh: ops.silu_mul_q(torch.cat([x, r], 1), D, shrink=sh)[0],
    ):
        made = _shrink(16, D, 2)
        sh = LoraShrink(made.a.cpu(), made.w.cpu(), torch.zeros(64, 16))
        y = make(sh)
        want = (y.double() @ sh.a.double().T) * sh.w[:2].double()
        assert torch.allclose(sh.t[:2].double(), want, rtol=1e-5, atol=1e-4)
        assert not sh.t[2:].any()


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("module", ["qkv", "down"])
@pytest.mark.parametrize("partial", [False, True], ids=["scratch", "partials"])
def test_a_module_takes_its_inputs_shrink(monkeypatch, module, partial):
    """With `PARTIAL_SHRINK` the input's kernel stores partials (the norm 1, the SiLU product
    one a column block) and the GEMV's epilogue sums them; the scratch is never touched."""
    from localllm.engine.loader import open_weights
    from localllm.engine.lora import LoraSpec
    from localllm.engine.lora.load import load_adapter
    from localllm.kernels.fused import triton_lora
    from localllm.kernels.fused.triton_ops import add_rms_norm_cuda, silu_mul_cuda
    from tests.lora.test_lora_epilogue_module import CHOICES, MODULES, _module, _truth

    monkeypatch.setattr(delta, "SCHEME", "epilogue")
    monkeypatch.setattr(delta, "PARTIAL_SHRINK", partial)  # (before the load: its buffer)
    g = open_weights(HF / "llama", "q8_0")
    try:
        adapters = [load_adapter(LoraSpec(str(LORA / n)), g) for n in ("llama-a", "llama-b")]
        lin, d = _module(g, adapters, MODULES[module])
    finally:
        g.close()
    launched = []
    real = triton_lora.shrink
    monkeypatch.setattr(triton_lora, "shrink", lambda *a: launched.append(1) or real(*a))
    rows_lora = [CHOICES[2], CHOICES[3], CHOICES[0]]
    d.ctx.set_rows([(c, 1) for c in rows_lora])
    n, k = len(rows_lora), lin.shape[1]
    gen = torch.Generator().manual_seed(9)
    with torch.inference_mode():
        sh = d.producer_shrink(n, d.scratch[0].device)
        assert sh is not None
        if module == "qkv":
            x, r = (torch.randn(n, k, generator=gen).to(DEVICE) for _ in range(2))
            _, y, _ = add_rms_norm_cuda(x, r, torch.ones(k, device=DEVICE), EPS, shrink=sh)
        else:
            gu = torch.randn(n, 2 * k, generator=gen).to(DEVICE)
            y, _ = silu_mul_cuda(gu, k, shrink=sh)
        # the input's kernel wrote t (or its partials)
        assert (d.partials if partial else d.scratch[0])[:n].any()
        tails = d.tails(y)
        assert tails is not None and not launched
        assert tails[0].np == (0 if not partial else 1 if module == "qkv" else -(-k // 256))
        got = lin.matmul(y, lora=tails[0]).cpu().double()
        assert not d.scratch[0].any() and not d.scratch[1].any(), "scratch left dirty"
        base = lin.matmul(y).cpu().double()
    dt = _truth(adapters, MODULES[module], y.cpu(), rows_lora)
    assert dt.abs().max().item() > 0.1
    assert (got - (base + dt)).abs().max().item() < 1e-5 * dt.abs().max().item()
    assert torch.equal(got[1], base[1])  # the row on no adapter: the base alone
    # a call of other rows than the shrink's is refused (t would be wrong)
    d.producer_shrink(n, d.scratch[0].device)
    with pytest.raises(RuntimeError, match="shrink of 3 rows"):
        d.tails(y[:2])


def test_attention_without_the_flash_kernel_runs_the_shrinks_torch_form():
    """Where the flash-decoding combine does not serve every row (here: a CPU cache), the
    paged cache's `attend_q` runs the output projection's shrink on its output itself."""
    from localllm.engine.core.batch import BatchMeta
    from localllm.engine.runtime.kv_cache import PagedKVCache

    gen = torch.Generator().manual_seed(4)
    kv = PagedKVCache(1, 4, 16, 2, 32, "f16", "cpu")
    meta = BatchMeta.from_tables([3, 1], [3, 1], [[0], [2]], 16)
    kv.write(0, torch.randn(4, 2, 32, generator=gen), torch.randn(4, 2, 32, generator=gen),
             meta.slot_mapping)  # fmt: skip
    q = torch.randn(4, 4, 32, generator=gen)
    made = _shrink(16, 4 * 32, 4, seed=3)
    sh = LoraShrink(made.a.cpu(), made.w.cpu(), torch.zeros(64, 16))
    o, _ = kv.attend_q(0, q, meta, 32**-0.5, shrink=sh)
    plain, _ = kv.attend_q(0, q, meta, 32**-0.5)
    assert torch.equal(o, plain)
    _check_t(sh, o.reshape(4, -1), 4)
