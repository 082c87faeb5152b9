"""LoRA adapters against transformers + PEFT in float32 on the tiny llama and qwen3 bases.

A PEFT folder and llama.cpp's GGUF conversion of it, on the safetensors base and on its GGUF
conversion: logits equal PEFT's to LOGIT_TOL (all four pairings), greedy tokens equal up to a
near-tie; scale 0 is the base bit for bit; a rank-4 rsLoRA on q/v/down only; two adapters at
once as PEFT's weighted sum; a `--quantize q8_0` base within the near-tie rule; an attention
adapter on a qwen3moe folder.
"""

import pytest
import torch

from localllm.engine.gguf import open_gguf
from localllm.engine.hf import open_hf
from localllm.engine.llm import LLM
from localllm.engine.loader import build_model
from localllm.engine.lora import LoraSpec, attach_adapters
from localllm.engine.sampling.params import SamplingParams
from tests.lora.lora_refs import (
    HF,
    LOGIT_TOL,
    LORA,
    assert_same_or_near_tie,
    hf_greedy,
    ids,
    our_logits,
    peft_model,
    ref_logits,
)

FAMILIES = ("llama", "qwen3")
N_GEN = 12


def build(family: str, base: str, adapters: list[str]):
    """Our model of the folder or GGUF base with adapters (paths under tests/data/lora)."""
    path = HF / family if base == "folder" else HF / f"{family}.gguf"
    with open_hf(path) if base == "folder" else open_gguf(path) as weights:
        model = build_model(weights, precise=True)
        attach_adapters(model, [LoraSpec(str(LORA / a)) for a in adapters], weights, "cpu")
    return model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("base", ["folder", "gguf"])
@pytest.mark.parametrize("form", ["peft", "gguf"])
def test_logits_match_peft(family, base, form):
    ref = peft_model(family, {f"{family}-a": 1.0})
    plain = peft_model(family, None)
    tokens = ids(24)
    want = ref_logits(ref, tokens)
    assert (want - ref_logits(plain, tokens)).abs().max() > 0.5  # the adapter changes a lot
    adapter = f"{family}-a" + (".gguf" if form == "gguf" else "")
    got = our_logits(build(family, base, [adapter]), tokens, [(0, 1.0)])
    err = (got - want).abs().max().item()
    assert err < LOGIT_TOL, f"max |ours - peft| = {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_scale_zero_is_the_base_exactly(family):
    model = build(family, "folder", [f"{family}-a"])
    tokens = ids(16, seed=2)
    base = build(family, "folder", [])
    assert torch.equal(our_logits(model, tokens, [(0, 0.0)]), our_logits(base, tokens))
    assert torch.equal(our_logits(model, tokens, []), our_logits(base, tokens))


def test_rslora_rank_4_partial_targets():
    """llama-b: r=4, use_rslora (alpha / sqrt(r)), only q/v/down targeted."""
    ref = peft_model("llama", {"llama-b": 1.0})
    tokens = ids(20, seed=3)
    got = our_logits(build("llama", "folder", ["llama-b"]), tokens, [(0, 1.0)])
    assert (got - ref_logits(ref, tokens)).abs().max().item() < LOGIT_TOL


def test_two_adapters_on_one_request_are_peft_weighted_sum():
    ref = peft_model("llama", {"llama-a": 0.5, "llama-b": 1.5})
    tokens = ids(20, seed=4)
    model = build("llama", "folder", ["llama-a", "llama-b"])
    got = our_logits(model, tokens, [(0, 0.5), (1, 1.5)])
    assert (got - ref_logits(ref, tokens)).abs().max().item() < LOGIT_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_peft(family):
    """The whole engine (prefill, decode, prefix cache salt) against PEFT's generate."""
    ref = peft_model(family, {f"{family}-a": 1.0})
    prompt = ids(10, seed=5)
    spec = LoraSpec(str(LORA / f"{family}-a.gguf"))
    with LLM(str(HF / f"{family}.gguf"), precise=True, kv_cache_dtype="f32", lora=(spec,)) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=N_GEN, ignore_eos=True)
        ours = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert_same_or_near_tie(ref, prompt, ours, hf_greedy(ref, prompt, N_GEN))


@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_q8_0_base_within_near_ties(family):
    """The base's weights made Q8_0 at load (default kernels), the adapter in float32."""
    ref = peft_model(family, {f"{family}-a": 1.0})
    prompt = ids(10, seed=6)
    spec = LoraSpec(str(LORA / f"{family}-a"))
    with LLM(str(HF / family), quantize="q8_0", kv_cache_dtype="f32", lora=(spec,)) as llm:
        types = {m.weight.qtype.name for m in llm.engine.model.modules()
                 if getattr(m, "lora", None) is not None and hasattr(m, "weight")}  # fmt: skip
        assert types == {"Q8_0"}
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        ours = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert_same_or_near_tie(ref, prompt, ours, hf_greedy(ref, prompt, 8))


def test_attention_adapter_on_a_moe_folder(tmp_path):
    """qwen3moe (a tiny folder made here): LoRA on q/k/v/o beside routed experts."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from tests.engine.hf_fixtures import save_tiny

    transformers.logging.set_verbosity_error()
    base = save_tiny("qwen3moe", tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    torch.manual_seed(5)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    ref = peft.get_peft_model(hf, cfg).eval()
    ref.save_pretrained(tmp_path / "adapter")
    tokens = ids(16, seed=11)
    with open_hf(base) as weights:
        model = build_model(weights, precise=True)
        attach_adapters(model, [LoraSpec(str(tmp_path / "adapter"))], weights, "cpu")
    got = our_logits(model, tokens, [(0, 1.0)])
    assert (got - ref_logits(ref, tokens)).abs().max().item() < LOGIT_TOL
