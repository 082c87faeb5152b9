"""Shared pieces of the LoRA tests: fixture paths, transformers+peft references, our logits,
`exact_deltas` (the deltas in float64: the yardstick of the kernels and the torch ops).

tests/data/lora/ (tests/tools/record_lora_fixtures.py): PEFT adapters with non-zero init of the
tiny tests/data/hf/ bases, and llama.cpp's `convert_lora_to_gguf.py` output of the `-a` ones.
"""

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.lora import delta
from localllm.engine.runtime.kv_cache import PagedKVCache

DATA = Path(__file__).parents[1] / "data"
HF, LORA = DATA / "hf", DATA / "lora"
LOGIT_TOL = 1e-4  # fp32 both sides, other summation orders (measured max ~3e-6)
TIE = 0.05  # tests/engine/near_ties.py's default


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def peft_model(family: str, adapters: dict[str, float] | None):
    """transformers fp32 of the base folder, with PEFT adapters {name: weight} (None: base).
    Several adapters are combined as PEFT's weighted sum of LoRA deltas (`add_weighted_adapter`
    with combination_type="cat" keeps each delta exact)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    transformers.logging.set_verbosity_error()
    base = transformers.AutoModelForCausalLM.from_pretrained(
        HF / family, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if not adapters:
        return base
    names = list(adapters)
    m = peft.PeftModel.from_pretrained(base, LORA / names[0], adapter_name=names[0])
    for n in names[1:]:
        m.load_adapter(LORA / n, adapter_name=n)
    if len(names) == 1 and adapters[names[0]] == 1.0:
        return m.eval()
    m.add_weighted_adapter(names, list(adapters.values()), "mix", combination_type="cat")
    m.set_adapter("mix")
    return m.eval()


@torch.inference_mode()
def ref_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]


@torch.inference_mode()
def our_logits(model, tokens: list[int], lora=()) -> torch.Tensor:
    """One sequence through the model with every row on `lora` ((slot, factor), ...)."""
    n = len(tokens)
    if getattr(model, "lora", None) is not None:
        model.lora.set_rows([(tuple(lora), n)])
    layers, kv_heads, head_dim = model.kv_shape()
    kv = PagedKVCache(layers, -(-n // 4), 4, kv_heads, head_dim, dtype="f32")
    h = model(torch.tensor(tokens), torch.arange(n), BatchMeta.contiguous(n, n, 4), kv)
    return model.logits(h)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def assert_same_or_near_tie(ref, prompt: list[int], ours: list[int], want: list[int]) -> None:
    """Equal token lists, or where they first part the reference scores both within TIE."""
    if ours == want:
        return
    i = next(j for j, (a, b) in enumerate(zip(ours, want, strict=True)) if a != b)
    logits = ref_logits(ref, prompt + want[:i])[-1]
    gap = abs((logits[ours[i]] - logits[want[i]]).item())
    assert gap < TIE, f"step {i}: ours {ours[i]} vs reference {want[i]}, logit gap {gap:.3f}"


def exact_delta(d: delta.LoraDelta, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(part, its delta [T, out_p]) of LoraDelta `d` for rows x, in float64 from the weights `d`
    holds (float16 on CUDA: a storage choice every scheme shares)."""
    t = (x.double() @ d.a.double().T) * d.ctx.view(d.sig, x.shape[0]).double()
    return [(i, t[:, lo:hi] @ b_t.double()) for i, lo, hi, b_t in d.b]


def _add(self, x, y):
    return y + exact_delta(self, x)[0][1].to(y.dtype) if self.ctx.active else y


def _add_parts(self, x, outs):
    outs = list(outs)
    for i, dd in exact_delta(self, x) if self.ctx.active else ():
        outs[i] = outs[i] + dd.to(outs[i].dtype)
    return outs


def _add_stacked(self, x, y):
    for i, dd in exact_delta(self, x) if self.ctx.active else ():
        y[:, self.offsets[i] : self.offsets[i + 1]] += dd.to(y.dtype)
    return y


@contextmanager
def exact_deltas(monkeypatch):
    """Inside: every LoraDelta adds `exact_delta` (no kernels, no epilogue tails). The torch ops
    round x, t and the delta to float16 on CUDA: 1e-3 off at a module, which the int8 activation
    codes of a Q8_0 model's dp4a GEMVs can carry to 0.04-0.1 in its logits (tests/perf/results/
    lora.md, 2026-12-06 16:42-16:49 UTC); the kernels keep float32 and land within ~1e-7 of this."""
    with monkeypatch.context() as m:
        m.setattr(delta, "KERNELS", False)
        m.setattr(delta.LoraDelta, "add", _add)
        m.setattr(delta.LoraDelta, "add_parts", _add_parts)
        m.setattr(delta.LoraDelta, "add_stacked", _add_stacked)
        yield
