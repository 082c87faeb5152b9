"""How far each LoRA kernel scheme and the torch ops land from float64 deltas in a model whose base
runs the packed dp4a GEMVs (issue 36; the diagnosis of tests/lora/test_lora_epilogue_gpu.py's
0.038 on the H100): the tiny llama folder made Q8_0, the PEFT adapters of tests/data/lora, one
row on both at 0.5 and 2.0 (or 4 rows on different adapters), on CPU tensors under the triton
interpreter. Not a test; prints, per scheme, the largest logit difference from the same model with
`tests.lora.lora_refs.exact_deltas`, then how many int8 activation codes of each base GEMV differ
between the torch ops' run (float16 x, t and delta) and the exact one. `--dense`: the base in
float32 instead (no activation codes; the "epilogue" and "inline" schemes then take no call).

    TRITON_INTERPRET=1 PYTHONPATH=/work/tri-site PYTHONSAFEPATH=1 \\
        python tests/perf/lora_scheme_accuracy.py [--rows 4] [--dense]
"""

import argparse

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.layers import linear as layer_linear
from localllm.engine.loader import build_model, open_weights
from localllm.engine.lora import LoraSpec, attach_adapters, delta
from localllm.engine.lora import attach as lora_attach
from localllm.engine.lora.delta import LoraContext, LoraDelta
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.quant import linear as quant_linear
from localllm.kernels.quant import triton_packed
from localllm.kernels.quant.types import QuantType
from tests.lora.lora_refs import HF, LORA, exact_deltas, ids

CHOICES = [((0, 1.0),), ((1, 1.0),), ((0, 0.5), (1, 2.0)), ()]
SPECS = (LoraSpec(str(LORA / "llama-a")), LoraSpec(str(LORA / "llama-b"), 0.0))
# the base GEMV calls of one step of the tiny llama (2 layers), in order
GEMVS = [
    f"blk.{i}.{n}" for i in (0, 1) for n in ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")
]
GEMVS.append("output")


def build(dense: bool):
    """The model on CPU with every linear on the packed triton GEMVs (or float32 tiles), and
    its LoRA deltas in the kernels' layout (float16 weights, scratch, epilogue tails)."""
    real = quant_linear.prepare_linear
    packed = (QuantType.Q8_0, QuantType.Q4_K, QuantType.Q6_K)

    def prepare(data, qtype, shape, precise=False, strategy=None, native=None):
        if QuantType(qtype) not in packed:
            return real(data, qtype, shape)
        return real(data, qtype, shape, strategy="dequant_tiles" if dense else "triton")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(layer_linear, "prepare_linear", prepare)
        m.setattr(layer_linear, "prepare_parts", lambda *a, **k: None)  # no native CPU kernels
        m.setattr(lora_attach, "LoraContext", lambda *a, **k: LoraContext(*a, **k, kernels=True))
        g = open_weights(HF / "llama", "q8_0")
        try:
            model = build_model(g, device="cpu")
            attach_adapters(model, list(SPECS), g, "cpu")
        finally:
            g.close()
    return model


def atomic_on_cpu(self, x, ys):
    """`LoraDelta._kernels` without its CUDA test: the "atomic" kernels under the interpreter."""
    from localllm.kernels.fused import triton_lora

    if not (delta.KERNELS and triton_lora.usable(x, self.kparts, ys)):
        return False
    w = self.ctx.buffers[self.sig]
    triton_lora.shrink_expand(x, self.a, w, self.kparts, ys, self.scratch)
    return True


@torch.inference_mode()
def logits(model, tokens, rows_lora):
    n = len(tokens)
    model.lora.set_rows(rows_lora)
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, 1, 16, kvh, hd, "f16", "cpu")
    h = model(torch.tensor(tokens), torch.arange(n), BatchMeta.contiguous(n, n, 16), kv)
    return model.logits(h).double()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--dense", action="store_true")
    args = ap.parse_args()
    rows = args.rows
    tokens = ids(rows, seed=3)  # as tests/lora/test_lora_epilogue_gpu.py
    mix = [CHOICES[2]] if rows == 1 else [*CHOICES, CHOICES[0]][:rows]
    spec = [(c, 1) for c in mix]
    model = build(args.dense)
    deltas = [m.lora for m in model.modules() if isinstance(getattr(m, "lora", None), LoraDelta)]
    n_tails = sum(d._tails is not None for d in deltas)
    codes: dict[str, list] = {}
    real_q = triton_packed.quantize_x8
    mp = pytest.MonkeyPatch()
    mp.setattr(delta.LoraDelta, "_kernels", atomic_on_cpu)
    out = {}
    for name, scheme, kernels in (
        ("torch ops", "atomic", False), ("atomic", "atomic", True),
        ("epilogue", "epilogue", True), ("inline", "inline", True), ("exact", None, False),
    ):  # fmt: skip
        log = codes.setdefault(name, [])

        def record(x, log=log):
            q = real_q(x)
            log.append(q.words.view(torch.int8).clone())
            return q

        mp.setattr(triton_packed, "quantize_x8", record)
        mp.setattr(delta, "SCHEME", scheme or "atomic")
        mp.setattr(delta, "KERNELS", kernels)
        model.lora._key = None
        if scheme is None:
            with exact_deltas(mp):
                out[name] = logits(model, tokens, spec)
        else:
            out[name] = logits(model, tokens, spec)
        clean = all(not d.scratch[0].any() and not d.scratch[1].any() for d in deltas)
        assert clean, f"{name}: a module's scratch left dirty"
    mp.setattr(triton_packed, "quantize_x8", real_q)
    base = logits(model, tokens, [((), rows)])
    mp.undo()
    want = out.pop("exact")
    kind = "float32 tiles" if args.dense else "packed dp4a GEMVs (int8 activation codes)"
    print(f"{rows} row(s), base: {kind}, modules with epilogue tails: {n_tails}")
    print(f"adapters move the logits by {(want - base).abs().max().item():.3f}")
    print("| scheme | max abs logits - float64 deltas | - torch ops |")
    print("|---|---:|---:|")
    for name, v in out.items():
        d, o = (v - want).abs().max().item(), (v - out["torch ops"]).abs().max().item()
        print(f"| {name} | {d:.2e} | {o:.2e} |")
    if args.dense:
        return
    print("\nint8 activation codes differing from the exact run's, per base GEMV call:")
    print("| GEMV (its input's codes) | codes | torch ops | epilogue |")
    print("|---|---:|---:|---:|")
    calls = zip(GEMVS, codes["exact"], codes["torch ops"], codes["epilogue"], strict=True)
    for name, exact, ops, epi in calls:
        print(f"| {name} | {exact.numel()} | {int((ops != exact).sum())} | "
              f"{int((epi != exact).sum())} |")  # fmt: skip


if __name__ == "__main__":
    main()
