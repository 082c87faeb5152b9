"""The "epilogue" and "inline" LoRA schemes at one module of the tiny llama folder made Q8_0 (the
case tests/lora/test_lora_epilogue_gpu.py runs through the whole model): its q | k | v (three
parts in one 64-column tile), gate | up (a tile per part) and down (split K) as packed dp4a
GEMVs, `LoraDelta` over the PEFT adapters of tests/data/lora, one row on both adapters at 0.5
and 2.0 (and four rows on different adapters, one on none). Each scheme's output lands within
float32 rounding of the float64 truth (the same base GEMV plus the deltas of the float16 weights
it holds) and no further off than the torch ops (float16 x, t and delta: ~1e-3 here), and
leaves the scratch at zero. Runs on CUDA (marked `gpu`) or under TRITON_INTERPRET=1 with CPU
tensors (`tests/triton_env.py`)."""

import pytest
import torch

from localllm.engine.loader import open_weights
from localllm.engine.lora import LoraSpec, delta
from localllm.engine.lora.delta import LoraContext, LoraDelta
from localllm.engine.lora.load import load_adapter
from tests.lora.lora_refs import HF, LORA
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS
CHOICES = [((0, 1.0),), ((1, 1.0),), ((0, 0.5), (1, 2.0)), ()]
MODULES = {
    "qkv": ["attn_q", "attn_k", "attn_v"],
    "gate_up": ["ffn_gate", "ffn_up"],
    "down": ["ffn_down"],
}
# of the largest delta; measured under the interpreter (2026-12-06): the schemes 7.5e-8 ..
# 2.4e-7 (float32 sums), the torch ops 2.4e-4 .. 5.2e-4 (float16 roundings); a rank of part k
# dropped in the boundary tile's path: 2.1e-2
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def weights():
    g = open_weights(HF / "llama", "q8_0")
    adapters = [load_adapter(LoraSpec(str(LORA / n)), g) for n in ("llama-a", "llama-b")]
    yield g, adapters
    g.close()


def _module(g, adapters, names: list[str]):
    """The packed GEMV of `names` (layer 0) stacked, and its LoraDelta bound to it."""
    from localllm.kernels.quant.triton_linear import TritonLinear

    ws = [g.weight(f"blk.0.{n}.weight") for n in names]
    sizes = [w.shape[0] for w in ws]
    data = torch.cat([w.data.reshape(w.shape[0], -1) for w in ws]).to(DEVICE)
    lin = TritonLinear(data, ws[0].qtype, (sum(sizes), ws[0].shape[1]))
    ctx = LoraContext(len(adapters), torch.device(DEVICE), kernels=True)
    parts = []  # as engine.lora.attach builds them: A stacked, B times its adapter's scaling
    for n in names:
        key = f"blk.0.{n}"
        pairs = [(s, *a.pairs[key], a.scalings[key]) for s, a in enumerate(adapters)
                 if key in a.pairs]  # fmt: skip
        a_cat = torch.cat([pa for _, pa, _, _ in pairs]).to(DEVICE)  # (on the device, as
        b_cat = torch.cat([pb * k for _, _, pb, k in pairs], dim=1).to(DEVICE)  # attach puts it)
        parts.append((a_cat, b_cat, [s for s, pa, _, _ in pairs for _ in range(pa.shape[0])]))
    d = LoraDelta(ctx, parts)
    d.bind([(lin, sizes)])
    return lin, d


def _truth(adapters, names, x: torch.Tensor, rows_lora) -> torch.Tensor:
    """The deltas [T, n] in float64 from the adapter files' pairs, stored as float16 (A, and B
    times its scaling: what the kernels and the torch ops both read)."""
    out = []
    for n in names:
        key = f"blk.0.{n}"
        y = torch.zeros(x.shape[0], adapters[0].pairs[key][1].shape[0], dtype=torch.float64)
        for r, lora in enumerate(rows_lora):
            for slot, factor in lora:
                if key not in adapters[slot].pairs:
                    continue  # (llama-b: q, v and down only)
                a, b = adapters[slot].pairs[key]
                k = adapters[slot].scalings[key]
                a16, b16 = a.half().double(), (b * k).half().double()
                y[r] += factor * (x[r].double() @ a16.T) @ b16.T
        out.append(y)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("scheme", ["epilogue", "inline"])
def test_scheme_matches_float64_truth(monkeypatch, weights, scheme, module, rows):
    g, adapters = weights
    names = MODULES[module]
    lin, d = _module(g, adapters, names)
    rows_lora = [CHOICES[2]] if rows == 1 else [*CHOICES[:rows]]
    d.ctx.set_rows([(c, 1) for c in rows_lora])
    x = torch.randn(rows, lin.shape[1], generator=torch.Generator().manual_seed(rows))
    xd = x.to(DEVICE)
    monkeypatch.setattr(delta, "SCHEME", scheme)
    with torch.inference_mode():
        base = lin.matmul(xd).cpu().double()
        tails = d.tails(xd)
        assert tails is not None and len(tails) == 1, "the scheme did not take the call"
        if scheme == "inline":
            assert d._inline is not None  # the shrink runs inside the GEMV
        got = lin.matmul(xd, lora=tails[0]).cpu().double()
        assert not d.scratch[0].any() and not d.scratch[1].any(), "scratch left dirty"
        monkeypatch.setattr(delta, "KERNELS", False)
        ops = d.add_stacked(xd, lin.matmul(xd)).cpu().double()
    dt = _truth(adapters, names, x, rows_lora)
    want = base + dt
    scale = dt.abs().max().item()
    err, err_ops = (got - want).abs().max().item(), (ops - want).abs().max().item()
    assert scale > 0.1  # the adapters really act
    assert err < REL_TOL * scale, (err, err_ops, scale)
    assert err <= err_ops, (err, err_ops)  # float32 sums: no worse than the float16 torch ops
    for r, lora in enumerate(rows_lora):
        if not lora:
            assert torch.equal(got[r], base[r])  # a row on no adapter: the base alone
