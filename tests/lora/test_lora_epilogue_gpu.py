"""The "epilogue" and "inline" LoRA schemes on CUDA (marked `gpu`): the shrink launched alone
(or done by the GEMV's first programs: "inline") and the expand added by the packed base GEMVs
(`engine.lora.delta.SCHEME`). The tiny llama folder,
made Q8_0 at load so that its linears run the packed dp4a GEMVs, with the PEFT adapters of
tests/data/lora: its logits equal those of the same model with float64 deltas (`exact_deltas`)
for one row on two adapters and for four rows on different adapters (one on none), no worse than
the torch ops' (float16: their 1e-3 at a module reach 0.04-0.1 in this model's logits through the
GEMVs' int8 activation codes, so they are no yardstick here), every module's scratch is left at
zero, and five rows (past the scheme's rows) take the atomic kernels; greedy decode with CUDA
graphs gives a mixed batch each request's alone tokens, and the same tokens as the default
scheme. "epilogue" runs q|k|v's, gate|up's, down's and the output projection's shrinks in the
norm, SiLU and flash-decoding kernels before them (PRODUCER_SHRINK: no shrink is launched),
"epilogue-launched" launches every shrink, "epilogue-partials" has those kernels store partial
shrinks that the GEMVs' epilogues sum (PARTIAL_SHRINK) in the tile finishers,
"epilogue-early" (the default) summed by split 0's programs (EARLY_TAIL). The
module-level checks, tighter: tests/lora/test_lora_epilogue_module.py,
tests/lora/test_lora_producer_shrink.py."""

import dataclasses

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.llm import LLM
from localllm.engine.lora import LoraSpec, delta
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.sampling.params import SamplingParams
from tests.lora.lora_refs import HF, LORA, TIE, exact_deltas, ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# as tests/lora/test_lora_gpu.py; against float64 deltas on the same Q8_0 base (only the deltas
# differ): the kernels were 0.0000 off under the CPU interpreter, the torch ops 0.038 / 0.106
# (1 / 4 rows; 0.038 on the H100 of 2026-12-06 16:14), tests/perf/results/lora.md
GPU_TOL = 0.02
OPS_MARGIN = 1e-3  # a scheme's logits are no further from the exact deltas than the torch ops
CHOICES = [((0, 1.0),), ((1, 1.0),), ((0, 0.5), (1, 2.0)), ()]
SPECS = (LoraSpec(str(LORA / "llama-a")), LoraSpec(str(LORA / "llama-b"), 0.0))


def _llm():
    return LLM(str(HF / "llama"), device="cuda", quantize="q8_0", lora=SPECS)


def _count_tails(monkeypatch) -> list[int]:
    """Counts the base GEMV calls that carry a LoRA epilogue."""
    from localllm.kernels.quant import triton_linear

    seen = [0]
    real = triton_linear.gemv_packed

    def spy(*args, **kw):
        lora = kw.get("lora", args[5] if len(args) > 5 else None)
        seen[0] += lora is not None
        return real(*args, **kw)

    monkeypatch.setattr(triton_linear, "gemv_packed", spy)
    return seen


SCHEMES = ["epilogue", "epilogue-partials", "epilogue-early", "epilogue-launched", "inline"]


def _scheme(monkeypatch, name: str) -> None:
    from localllm.kernels.quant import triton_lora_tail

    monkeypatch.setattr(delta, "SCHEME", name.split("-")[0])
    monkeypatch.setattr(delta, "PRODUCER_SHRINK", "-launched" not in name)
    monkeypatch.setattr(delta, "PARTIAL_SHRINK", "-partials" in name or "-early" in name)
    monkeypatch.setattr(triton_lora_tail, "EARLY_TAIL", "-early" in name)


@pytest.mark.parametrize("scheme", SCHEMES)
@torch.inference_mode()
def test_epilogue_near_exact_deltas(monkeypatch, scheme):
    from localllm.kernels.fused import triton_lora

    _scheme(monkeypatch, scheme)
    seen = _count_tails(monkeypatch)
    launched = [0]
    real = triton_lora.shrink
    monkeypatch.setattr(triton_lora, "shrink", lambda *a: launched.__setitem__(0, launched[0] + 1)
                        or real(*a))  # fmt: skip
    with _llm() as llm:
        model = llm.engine.model
        deltas = [m.lora for m in model.modules()
                  if isinstance(getattr(m, "lora", None), delta.LoraDelta)]  # fmt: skip
        assert any(d._tails for d in deltas), "no module got epilogue tails (packed GEMVs?)"
        if scheme == "inline":
            assert all(d._inline for d in deltas if d._tails)
        # the launched shrinks a forward: every module's, or none (the norm, SiLU and attention
        # kernels run them; a prompt's attention output: its torch form)
        wide = [d for d in deltas if d._tails and d.a.shape[0] > d.producer_max_rank()]
        producers = scheme in ("epilogue", "epilogue-partials", "epilogue-early")
        want = len(wide) if producers else sum(1 for d in deltas if d._tails)
        for rows in (1, 4, 5):
            _rows_near_exact_deltas(monkeypatch, model, deltas, seen, rows)
            if rows <= delta.EPILOGUE_ROWS and scheme != "inline":
                launched[0] = 0
                model.lora.set_rows([(CHOICES[2], rows)])
                _forward(model, ids(rows, seed=3))
                assert launched[0] == want, (rows, launched[0], want)


def _forward(model, tokens: list[int]) -> torch.Tensor:
    rows = len(tokens)
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, 1, 16, kvh, hd, "f16", "cuda")
    b = BatchMeta.contiguous(rows, rows, 16)
    b = dataclasses.replace(b, slot_mapping=b.slot_mapping.to("cuda"))
    pos = torch.arange(rows, device="cuda")
    h = model(torch.tensor(tokens, device="cuda"), pos, b, kv)
    return model.logits(h).float().cpu()


def _rows_near_exact_deltas(monkeypatch, model, deltas, seen, rows: int) -> None:
    tokens = ids(rows, seed=3)
    if rows == 1:
        model.lora.set_rows([(CHOICES[2], 1)])
    else:
        mix = [*CHOICES, CHOICES[0]][:rows]
        model.lora.set_rows([(c, 1) for c in mix])

    def run():
        return _forward(model, tokens)

    seen[0] = 0
    got = run()
    assert delta.KERNELS
    assert (seen[0] > 0) == (rows <= delta.EPILOGUE_ROWS), rows  # 5 rows: the atomic kernels
    # t and its counters back at zero
    assert all(not d.scratch[0].any() and not d.scratch[1].any()
               for d in deltas if d.scratch is not None), rows  # fmt: skip
    again = run()
    assert (again - got).abs().max().item() < 1e-3, rows  # the scratch was clean
    monkeypatch.setattr(delta, "KERNELS", False)
    ops = run()
    monkeypatch.setattr(delta, "KERNELS", True)
    with exact_deltas(monkeypatch):
        want = run()
    err, err_ops = ((v - want).abs().max().item() for v in (got, ops))
    assert err < GPU_TOL, (rows, err, err_ops)
    assert err <= err_ops + OPS_MARGIN, (rows, err, err_ops)
    model.lora.set_rows([((), rows)])
    base = run()
    assert (got - base).abs().max().item() > 5 * GPU_TOL, rows  # the adapters really act


def _last_logits(model, tokens: list[int], lora) -> torch.Tensor:
    n = len(tokens)
    model.lora.set_rows([(tuple(lora), n)])
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, -(-n // 16), 16, kvh, hd, "f16", "cuda")
    b = BatchMeta.contiguous(n, n, 16)
    b = dataclasses.replace(b, slot_mapping=b.slot_mapping.to("cuda"))
    h = model(torch.tensor(tokens, device="cuda"), torch.arange(n, device="cuda"), b, kv)
    return model.logits(h).float().cpu()[-1]


def _same_or_near_tie(model, prompt, lora, a: list[int], b: list[int]) -> None:
    """Equal greedy tokens, or the first difference a near-tie of this model's logits."""
    if a == b:
        return
    i = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    logits = _last_logits(model, prompt + a[:i], lora)
    assert abs((logits[a[i]] - logits[b[i]]).item()) < TIE, f"step {i}: not a near-tie"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_graph_decode_mixed_batches(monkeypatch, scheme):
    seen = _count_tails(monkeypatch)
    prompt = ids(40, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, lora=c)
              for c in CHOICES]  # fmt: skip
    runs = {}
    for run in (scheme, "atomic"):
        _scheme(monkeypatch, run)
        with _llm() as llm:
            together = llm.generate([prompt] * len(CHOICES), params)
            alone = [llm.generate([prompt], p)[0] for p in params]
            graphs = llm.engine.runner.graphs
            assert graphs is not None and {k[-1] for k in graphs.graphs} == {False, True}
            runs[run] = [[list(o.outputs[0].token_ids) for o in outs]
                            for outs in (together, alone)]  # fmt: skip
            if run == scheme:
                assert seen[0] > 0  # the captured decode steps hold epilogue GEMVs
                model = llm.engine.model
                with torch.inference_mode():
                    for c, t, a in zip(CHOICES, *runs[run], strict=True):
                        _same_or_near_tie(model, prompt, c, a, t)  # mixed against alone
                assert len({tuple(t) for t in runs[run][1]}) == len(CHOICES)
    with _llm() as llm, torch.inference_mode():
        for c, a, d in zip(CHOICES, runs[scheme][1], runs["atomic"][1], strict=True):
            _same_or_near_tie(llm.engine.model, prompt, c, d, a)  # against the default scheme
