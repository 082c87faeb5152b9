"""LoRA on CUDA (marked `gpu`): the default kernels with decode CUDA graphs and prompt graphs keep
an adapter's logits near the CPU float32 reference (which tests/lora/test_lora_reference.py holds
to transformers+peft within 1e-4) and its greedy tokens equal up to a near-tie of that reference;
a batch mixing adapters (and none) gives each request its alone run's tokens, the row factors
written into the captured graphs' buffers between steps. Needs no transformers on the device."""

import dataclasses

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.llm import LLM
from localllm.engine.loader import build_model
from localllm.engine.lora import LoraSpec, attach_adapters, delta
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.sampling.params import SamplingParams
from tests.lora.lora_refs import HF, LORA, TIE, ids, our_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU_TOL = 0.02  # default CUDA kernels, f16 KV, against fp32 (as test_converted_families_gpu)
CHOICES = [((0, 1.0),), ((1, 1.0),), ((0, 0.5), (1, 2.0)), ()]
SPECS = (LoraSpec(str(LORA / "llama-a.gguf")), LoraSpec(str(LORA / "llama-b"), 0.0))


def _build(base: str, specs, device: str):
    with open_gguf(HF / base) as g:
        model = build_model(g, precise=device == "cpu", device=device)
        attach_adapters(model, list(specs), g, device)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.inference_mode()
def test_logits_near_the_cpu_reference(family):
    specs = [LoraSpec(str(LORA / f"{family}-a.gguf"))]
    model = _build(f"{family}.gguf", specs, "cuda")
    tokens = ids(24)
    n = len(tokens)
    model.lora.set_rows([(((0, 1.0),), n)])
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, -(-n // 16), 16, kvh, hd, "f16", "cuda")
    b = BatchMeta.contiguous(n, n, 16)
    b = dataclasses.replace(b, slot_mapping=b.slot_mapping.to("cuda"))
    h = model(torch.tensor(tokens, device="cuda"), torch.arange(n, device="cuda"), b, kv)
    got = model.logits(h).float().cpu()
    want = our_logits(_build(f"{family}.gguf", specs, "cpu"), tokens, [(0, 1.0)])
    assert (got - want).abs().max().item() < GPU_TOL


def _near_tie(ref, prompt, lora, a: list[int], b: list[int]) -> None:
    if a == b:
        return
    i = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    logits = our_logits(ref, prompt + b[:i], lora)[-1]
    assert abs((logits[a[i]] - logits[b[i]]).item()) < TIE, f"step {i}: not a near-tie"


def test_greedy_and_mixed_batches_on_cuda():
    prompt = ids(40, seed=7)  # two full KV blocks: the prefix cache is in play
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, lora=c)
              for c in CHOICES]  # fmt: skip
    with LLM(str(HF / "llama.gguf"), device="cuda", lora=SPECS) as llm:
        together = llm.generate([prompt] * len(CHOICES), params)
        alone = [llm.generate([prompt], p)[0] for p in params]
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.graphs  # decode steps replayed captured graphs
        # steps with no row on an adapter replay their own captures (no LoRA kernels in them)
        assert {k[-1] for k in graphs.graphs} == {False, True}, list(graphs.graphs)
    with LLM(str(HF / "llama.gguf"), precise=True, kv_cache_dtype="f32", lora=SPECS) as cpu:
        want = [list(o.outputs[0].token_ids) for o in cpu.generate([prompt] * 4, params)]
    tokens = [list(o.outputs[0].token_ids) for o in alone]
    assert len({tuple(t) for t in tokens}) == len(CHOICES)
    ref = _build("llama.gguf", SPECS, "cpu")
    with torch.inference_mode():
        for c, t, o, w in zip(CHOICES, tokens, together, want, strict=True):
            _near_tie(ref, prompt, c, t, w)  # alone on CUDA against the CPU reference
            _near_tie(ref, prompt, c, list(o.outputs[0].token_ids), t)  # mixed against alone


@pytest.mark.parametrize("scheme", ["atomic", "fused"])
@pytest.mark.parametrize("rows", [1, 5])
@torch.inference_mode()
def test_kernels_equal_the_torch_ops(monkeypatch, rows, scheme):
    """A step with rows on different adapters (and one on none; or one row on two adapters, the
    kernels' broadcast path): the triton kernels of each scheme (shrink, expand into q/k/v,
    gate/up, ...) give the torch ops' logits, and leave every module's scratch at zero."""
    monkeypatch.setattr(delta, "SCHEME", scheme)
    model = _build("llama.gguf", SPECS, "cuda")
    tokens = ids(rows, seed=3)
    choices = [(c, 1) for c in CHOICES] + [(CHOICES[0], 1)] if rows > 1 else [(CHOICES[2], 1)]
    model.lora.set_rows(choices)

    def run():
        layers, kvh, hd = model.kv_shape()
        kv = PagedKVCache(layers, 1, 16, kvh, hd, "f16", "cuda")
        b = BatchMeta.contiguous(rows, rows, 16)
        b = dataclasses.replace(b, slot_mapping=b.slot_mapping.to("cuda"))
        h = model(torch.tensor(tokens, device="cuda"), torch.arange(rows, device="cuda"), b, kv)
        return model.logits(h).float().cpu()

    got = run()
    assert delta.KERNELS  # not switched off by a kernel failure (then both runs are torch ops)
    deltas = [m.lora for m in model.modules() if getattr(m, "lora", None) is not None
              and isinstance(m.lora, delta.LoraDelta)]  # fmt: skip
    assert deltas and all(not d.scratch[0].any() and not d.scratch[1].any() for d in deltas)
    again = run()
    assert (again - got).abs().max().item() < 1e-3  # the scratch was clean for the second step
    monkeypatch.setattr(delta, "KERNELS", False)
    want = run()
    assert (got - want).abs().max().item() < GPU_TOL
    model.lora.set_rows([((), rows)])
    base = run()
    assert (got - base).abs().max().item() > 5 * GPU_TOL  # the adapters really act
