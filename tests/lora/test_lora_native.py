"""LoRA in the native CPU decode step (`kernels/cpu/decode_step.c`'s `lora_add`): SmolLM2 with two
random rank-4 llama.cpp-format adapters (bench_lora.py's writer) on every attention and MLP
linear, teacher-forced decode steps of a batch whose rows use adapter 0, both at other scales,
and none. The native step takes these steps (it used to leave them to the torch layers) and its
logits match the torch layers on the same int8-activation linears as closely as without
adapters, while the adapters move them far more than that."""

import argparse

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.generator import Generator
from localllm.engine.layers.native_decode import NativeDecode
from localllm.engine.lora import LoraSpec, attach_adapters
from localllm.kernels.cpu import decode_lora
from localllm.kernels.quant.linear_native import NativeLinear
from tests.perf.bench_lora import make

ROWS = [
    ((0, 16.0),),
    ((0, 8.0), (1, 16.0)),
    (),
]  # strong: far above int8 noise  # per sequence: (adapter id, scale)


@pytest.fixture(scope="module")
def adapters(smollm2_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("native-lora")
    make(argparse.Namespace(model=str(smollm2_path), out=str(out), rank=4, count=2))
    return [LoraSpec(str(out / f"lora-{k}.gguf")) for k in range(2)]


def _steps(gen: Generator, lora: bool) -> torch.Tensor:
    """Logits [steps, 3, vocab] of 6 decode steps of 3 sequences (prompts of 5, 9, 13 tokens)."""
    m = gen.model
    kv = gen._cache(64 * 3)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 2000, (n + 6,), generator=g).tolist() for n in (5, 9, 13)]
    tables = [tuple(range(4 * i, 4 * i + 4)) for i in range(3)]
    out = []
    with torch.inference_mode():
        for s, table in zip(seqs, tables, strict=True):  # the prompts, one by one
            n = len(s) - 6
            m.lora.set_rows([(ROWS[tables.index(table)] if lora else (), n)])
            slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(n)])
            m(torch.tensor(s[:n]), torch.arange(n), BatchMeta((0, n), (n,), (table,), slots, 16),
              kv)  # fmt: skip
        m.lora.set_rows([(r if lora else (), 1) for r in ROWS])
        for k in range(6):
            pos = [len(s) - 6 + k for s in seqs]
            slots = torch.tensor(
                [t[p // 16] * 16 + p % 16 for t, p in zip(tables, pos, strict=True)]
            )
            batch = BatchMeta((0, 1, 2, 3), tuple(p + 1 for p in pos), tuple(tables), slots, 16)
            ids = torch.tensor([s[p] for s, p in zip(seqs, pos, strict=True)])
            out.append(m.logits(m(ids, torch.tensor(pos), batch, kv)).float())
    return torch.stack(out)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


def test_native_step_takes_lora_steps(smollm2_path, adapters, monkeypatch):
    """Against exact math (float32 matmuls, the torch layers) with the same adapters: the native
    step is no further than the torch layers on its int8-activation linears, and far closer than
    the base without adapters is (the deltas are really in it)."""
    gen = Generator.load(str(smollm2_path))
    exact = Generator.load(str(smollm2_path), precise=True)
    try:
        attach_adapters(gen.model, adapters, gen.gguf, "cpu")
        attach_adapters(exact.model, adapters, exact.gguf, "cpu")
        tables = []
        real = decode_lora.set_table

        def spy(lib, t):
            tables.append(t)
            real(lib, t)

        monkeypatch.setattr(decode_lora, "set_table", spy)
        native = _steps(gen, True)
        assert isinstance(gen.model._native_step, NativeDecode)
        assert any(t is not None for t in tables)  # the LoRA steps ran natively
        gen.model._native_step = False  # the torch layers, on int8 activations like the step
        for m in gen.model.modules():
            for k in m.kernels() if hasattr(m, "kernels") and callable(m.kernels) else ():
                if isinstance(k, NativeLinear):
                    k.int8_max_t = 64  # (NativeLinear: int8 rows up to this many)
        eager = _steps(gen, True)
        want, base = _steps(exact, True), _steps(exact, False)
    finally:
        gen.close()
        exact.close()
    on = slice(0, 2)  # the rows on adapters
    kl_native, kl_eager = _kl(want[:, on], native[:, on]), _kl(want[:, on], eager[:, on])
    kl_base = _kl(want[:, on], base[:, on])
    print(f"KL to exact: native {kl_native:.5f}, torch {kl_eager:.5f}, no adapters {kl_base:.5f}")
    assert kl_native < 1.5 * kl_eager + 1e-4, (kl_native, kl_eager)
    assert kl_base > 10 * kl_native, (kl_base, kl_native)
    # the row on no adapter: the base's own
    assert _kl(base[:, 2], native[:, 2]) < 1.5 * _kl(base[:, 2], eager[:, 2]) + 1e-4
