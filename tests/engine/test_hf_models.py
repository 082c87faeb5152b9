"""Hugging Face folders of every mapped family against transformers on the same weights.

Each family's tiny folder is made here with transformers (`hf_fixtures`, bf16 as most Hub
checkpoints) and loaded by `engine.hf`; transformers runs the same bf16 weights in float32 as
the reference. Logits must agree to LOGIT_TOL, greedy tokens exactly or up to a near-tie of
the reference (the rule of `near_ties.py`: where the token lists first part, transformers'
fp32 logits of the two choices are within TIE); `--quantize q8_0` within the same rule.
"""

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.hf import open_hf
from localllm.engine.layers.linear import QuantLinear
from localllm.engine.llm import LLM
from localllm.engine.loader import build_model
from localllm.engine.moe.expert_tensor import ExpertTensor
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.sampling.params import SamplingParams
from tests.engine.hf_fixtures import FAMILIES, available, save_tiny

LOGIT_TOL = 1e-4  # fp32 both sides, different summation orders (measured max ~2e-6)
TIE = 0.05  # near_ties.py's default
N_GEN = 16
PROMPT = "Hello, world! The quick brown"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("hf")
    return {f: save_tiny(f, root / f, shards=f == "qwen2") for f in FAMILIES if available(f)}


@pytest.fixture(scope="module")
def reference(folders):
    """reference(family) -> (transformers fp32 model, its tokenizer), cached."""
    import transformers

    cache = {}

    def load(family):
        if family not in folders:
            pytest.skip(f"transformers {transformers.__version__} lacks the {family} classes")
        if family not in cache:
            d = folders[family]
            m = transformers.AutoModelForCausalLM.from_pretrained(
                d, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            cache[family] = (m, transformers.AutoTokenizer.from_pretrained(d))
        return cache[family]

    return load


@torch.inference_mode()
def our_logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    layers, kv_heads, head_dim = model.kv_shape()
    kv = PagedKVCache(layers, -(-n // 4), 4, kv_heads, head_dim, dtype="f32")
    h = model(torch.tensor(ids), torch.arange(n), BatchMeta.contiguous(n, n, 4), kv)
    return model.logits(h)


@torch.inference_mode()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def assert_same_or_near_tie(hf, prompt: list[int], ours: list[int], want: list[int]) -> None:
    """Equal token lists, or where they first part the reference scores both within TIE."""
    if ours == want:
        return
    i = next(j for j, (a, b) in enumerate(zip(ours, want, strict=True)) if a != b)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + want[:i]])).logits[0, -1]
    gap = abs((logits[ours[i]] - logits[want[i]]).item())
    assert gap < TIE, f"step {i}: ours {ours[i]} vs reference {want[i]}, logit gap {gap:.3f}"


def ids(n: int, vocab: int, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, folders, reference):
    hf, _ = reference(family)
    with open_hf(folders[family]) as ck:
        model = build_model(ck, precise=True)
    tokens = ids(24, hf.config.get_text_config().vocab_size - 3)  # no image tokens
    got = our_logits(model, tokens)
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0]
    assert got.shape == want.shape
    assert want.std() > 0.3  # logits carry signal: a broken mapping cannot match by accident
    err = (got - want).abs().max().item()
    assert err < LOGIT_TOL, f"{family}: max |ours - transformers| = {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(family, folders, reference):
    """The whole engine on the folder (its tokenizer too) against transformers' generate."""
    hf, tok = reference(family)
    prompt = tok(PROMPT)["input_ids"]
    llm = LLM(str(folders[family]), precise=True, kv_cache_dtype="f32")
    assert llm.engine.tokenize(PROMPT) == prompt
    params = SamplingParams(temperature=0.0, max_tokens=N_GEN, ignore_eos=True)
    ours = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
    llm.engine.close()
    assert len(ours) == N_GEN
    assert_same_or_near_tie(hf, prompt, ours, hf_greedy(hf, prompt, N_GEN))


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3moe", "glm4moe"])
def test_quantize_q8_0_stays_within_near_ties(family, folders, reference):
    """Weights quantized to Q8_0 at load, default kernels: transformers' fp32 greedy tokens, up
    to near-ties; and the linears really hold Q8_0 blocks."""
    hf, tok = reference(family)
    prompt = tok(PROMPT)["input_ids"]
    llm = LLM(str(folders[family]), quantize="q8_0", kv_cache_dtype="f32")
    types = {
        name.rsplit(".", 1)[-1]: m.weight.qtype.name
        for name, m in llm.engine.model.named_modules()
        if isinstance(m, QuantLinear | ExpertTensor) and m.weight is not None
    }
    router = types.pop("ffn_gate_inp", "F32")  # MoE routers stay float32, as llama.cpp's
    assert set(types.values()) == {"Q8_0"} and router == "F32"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
    llm.engine.close()
    assert_same_or_near_tie(hf, prompt, ours, hf_greedy(hf, prompt, 8))


def test_sharded_folder_reads_every_shard(folders):
    with open_hf(folders["qwen2"]) as ck:
        assert len(ck.shards) > 1
        assert "blk.1.attn_q.bias" in ck.tensors


def test_weights_used_as_stored_are_views_of_the_mapping(folders):
    """No copy at load: bf16 linears alias the shard's mmap, so two tensors lie as far apart in
    memory as in the file; llama's rope-permuted q/k are made at load (copies)."""
    with open_hf(folders["qwen3"]) as ck:
        a, b = ck.weight("blk.0.ffn_up.weight"), ck.weight("blk.1.attn_q.weight")
        assert a.qtype.name == b.qtype.name == "BF16"
        assert b.data.data_ptr() - a.data.data_ptr() == b.source.offset - a.source.offset
        assert ck.weight("blk.0.ffn_up.weight").data.data_ptr() == a.data.data_ptr()
    with open_hf(folders["llama"]) as ck:
        assert ck.tensors["blk.0.attn_v.weight"].range is not None
        assert ck.tensors["blk.0.attn_q.weight"].range is None  # permuted: made at load


def test_quantize_matches_gguf_py(folders):
    """`--quantize` blocks are gguf-py's (ggml's reference quantizer) on the bf16 values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from localllm.engine.hf.safetensors import SafetensorsFile

    st = SafetensorsFile(folders["qwen3"] / "model.safetensors")
    x = st.view("model.layers.1.mlp.down_proj.weight").float().numpy()
    for name in ("q8_0", "q4_0", "q5_1"):
        with open_hf(folders["qwen3"], quantize=name) as ck:
            got = ck.weight("blk.1.ffn_down.weight").data.numpy()
        want = gguf_quantize(x, GGMLQuantizationType[name.upper()])
        assert (got == want).all(), name
