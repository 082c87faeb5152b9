"""The native CPU decode step on every family it takes (llama, SmolLM3's NoPE layers, Qwen2's
q/k/v biases, Qwen3's q/k norms, Gemma 3, gpt-oss's sinks, biases and MXFP4 experts, GLM-4.5's
and LFM2-MoE's sigmoid routing, shared expert and leading dense layers, Granite-4.0-H's Mamba-2
layers, Gemma 2's capped scores, Phi-3's fused tensors, OLMo 2's whole-width q / k norms,
Qwen3-Next's Gated DeltaNet layers, gated queries and gated shared expert):
teacher-forced decode logits of the step against the torch layers on the same int8-activation
linears, and against exact math, on tiny quantized models (`tiny_models`, `test_gpt_oss`)."""

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.layers.native_decode import NativeDecode
from localllm.engine.loader import build_model
from localllm.engine.lora import LoraSpec, attach_adapters
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states
from localllm.kernels.cpu import decode_lora, decode_step
from localllm.kernels.quant.linear_native import NativeLinear
from tests.engine.tiny_models import SPECS, TinySpec, write_tiny_gguf
from tests.perf.bench_lora import make

BS = 16
FAMILIES = {
    "llama": SPECS["llama"],
    "qwen2": SPECS["qwen2"],  # q/k/v biases
    "qwen3": SPECS["qwen3"],
    "gemma3": SPECS["gemma3"],
    "phi3": SPECS["phi3"],  # q|k|v and gate|up each one tensor, partial rotary
    "phi3_longrope": SPECS["phi3_longrope"],  # the rope table's long factors and attn factor
    # layer 3 is NoPE ((il + 1) % 4 == 0): attention by content alone
    "smollm3": dataclasses.replace(SPECS["llama"], arch="smollm3", n_layers=4),
}
pytestmark = pytest.mark.skipif(decode_step.load() is None, reason="no C compiler")


def _logits(path, tokens: list[int], n_prompt: int, native: bool, precise: bool = False,
            adapters: list | None = None):  # fmt: skip
    """Decode logits teacher-forced on `tokens` after a prompt of n_prompt of them; native=False
    runs the torch layers with the step's int8 activations (int8_max_t 64); `adapters`: LoRA
    adapters, the sequence on the first at scale 16."""
    gguf = open_gguf(str(path))
    try:
        model = build_model(gguf, precise=precise)
        on = ((0, 16.0),) if adapters else ()
        if adapters:
            attach_adapters(model, adapters, gguf, "cpu")
        layers, kvh, hd = model.kv_shape()
        kv = PagedKVCache(layers, 8, BS, kvh, hd, "f32", "cpu", model.kv_value_dim())
        attach_states(kv, model, 1)  # (LFM2's conv states: slot 0, the one sequence's)
        if not native:
            model._native_step = False
            for m in model.modules():
                for k in m.kernels() if callable(getattr(m, "kernels", None)) else ():
                    if isinstance(k, NativeLinear):
                        k.int8_max_t = 64
        out = []
        with torch.inference_mode():
            if adapters:
                model.lora.set_rows([(on, n_prompt)])
            model(torch.tensor(tokens[:n_prompt]), torch.arange(n_prompt),
                  BatchMeta.contiguous(n_prompt, n_prompt, BS), kv)  # fmt: skip
            for p in range(n_prompt, len(tokens)):
                table = tuple(range(p // BS + 1))
                batch = BatchMeta((0, 1), (p + 1,), (table,), torch.tensor([p]), BS)
                if adapters:
                    model.lora.set_rows([(on, 1)])
                out.append(model.logits(model(torch.tensor([tokens[p]]), torch.tensor([p]),
                                              batch, kv))[0])  # fmt: skip
        # (the step built over this cache: no layer's layout was refused)
        ran = isinstance(model._native_step, NativeDecode) and model._native_step._step is not None
        return torch.stack(out).double(), ran
    finally:
        gguf.close()


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = p.log_softmax(-1), q.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_native_step_decodes_each_family_like_the_torch_layers(tmp_path, family):
    spec: TinySpec = FAMILIES[family]
    path = write_tiny_gguf(tmp_path / f"{family}.gguf", spec, quant=True, seed=3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, spec.vocab, (40,), generator=g).tolist()  # 40 > the 16-key blocks
    _step_like_torch_layers(path, tokens, family)


def _step_like_torch_layers(path, tokens: list[int], name: str) -> None:
    """The step took the model, and its teacher-forced logits are no further from exact math
    than the torch layers' on the same int8 linears (other roundings elsewhere, and int8
    rounding flips that follow from them), nor their greedy tokens."""
    native, ran = _logits(path, tokens, 5, native=True)
    assert ran, f"{name}: the native step did not take the model"
    torch_int8, _ = _logits(path, tokens, 5, native=False)
    exact, _ = _logits(path, tokens, 5, native=False, precise=True)
    kl_native, kl_torch = _kl(exact, native), _kl(exact, torch_int8)
    print(f"{name}: KL to exact math: native {kl_native:.2e}, torch layers {kl_torch:.2e}")
    assert kl_native < 1.5 * kl_torch + 1e-5, (kl_native, kl_torch)
    top = exact.argmax(-1)
    agree = [(x.argmax(-1) == top).double().mean().item() for x in (native, torch_int8)]
    assert agree[0] >= agree[1] - 2 / len(top), agree


def _gpt_oss_q8(path):
    """test_gpt_oss's tiny model with its attention linears in Q8_0 (native block types; its
    experts are MXFP4 already): the step takes it."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    from tests.engine import test_gpt_oss as oss
    from tests.engine.tiny_models import write_gguf

    t = oss._tensors(seed=3)
    for name in [n for n in t if n.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                             "attn_output.weight"))]:  # fmt: skip
        t[name] = (quantize(t[name], QT.Q8_0), QT.Q8_0)
    return write_gguf(path, "gpt-oss", oss.META, t)


def test_native_step_decodes_gpt_oss_like_the_torch_layers(tmp_path):
    """Sinks, q|k|v and output biases, a window on every other layer (8 keys: 40 tokens pass
    it), the biased router, MXFP4 experts with biases and the clamped SwiGLU."""
    path = _gpt_oss_q8(tmp_path / "gpt-oss.gguf")
    tokens = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    _step_like_torch_layers(path, tokens, "gpt-oss")


def _glm_air(path):
    """A tiny GLM-4.5-Air (make_glm4moe.py's writer, Q8_0): a leading dense layer narrower than
    the MoE layers' k x experts, sigmoid routing with a choice bias, a shared expert, biased
    q/k/v, partial rope, no q/k norms."""
    from tests.perf import make_glm4moe as glm

    sizes = {"dim": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "hidden": 384}
    shape = glm.Shape(n_layers=3, n_dense=1, vocab=512, n_expert=8, n_used=2, expert_ff=256,
                      n_shared=1, **sizes)  # fmt: skip
    glm.write(path, shape, "Q8_0", None, seed=4)
    return path


def _lfm2moe(path):
    """A tiny LFM2-MoE (make_hybrid_synthetic.py's writer, Q4_K / Q6_K): short-conv layers and one
    attention layer, a leading dense layer narrower than the MoE layers' k x experts, sigmoid
    routing with a choice bias."""
    from tests.perf.make_hybrid_synthetic import Hybrid, write_hybrid

    write_hybrid(path, Hybrid("lfm2moe", 4, (2,), 256, 4, 2, 256, 512, n_expert=4, n_used=2,
                              n_dense=1, expert_ff=256), None, seed=5)  # fmt: skip
    return path


@pytest.mark.parametrize("family", ["glm4moe", "lfm2moe"])
def test_native_step_decodes_sigmoid_routed_moe_like_the_torch_layers(tmp_path, family):
    path = (_glm_air if family == "glm4moe" else _lfm2moe)(tmp_path / f"{family}.gguf")
    tokens = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    _step_like_torch_layers(path, tokens, family)


def _converted_q8(path, family: str):
    """A converted tiny fixture (transformers' model through llama.cpp's converter) with its
    linears in Q8_0 (native block types; the file's are F16)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    from tests.engine.hostile_gguf import base, write_variant

    linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    q8 = {}
    for name, (data, qtype, shape) in base(family)[2].items():
        if name.split(".")[-2] in linears:
            assert qtype == QT.F16, (name, qtype)
            w = data.view("float16").astype("float32").reshape(shape)
            q8[name] = (quantize(w, QT.Q8_0), QT.Q8_0, shape)
    return write_variant(path, family, tensors=q8)


@pytest.mark.parametrize("family", ["gemma2", "olmo2"])
def test_native_step_decodes_converted_families_like_the_torch_layers(tmp_path, family):
    """Gemma 2: attention scores capped at 2, a 4-key window on even layers, GeGLU,
    post-norms; OLMo 2: q / k norms over all heads, no input norms, post-norms."""
    path = _converted_q8(tmp_path / f"{family}.gguf", family)
    vocab = 145  # (the smaller of the two fixtures' vocabularies)
    tokens = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    _step_like_torch_layers(path, tokens, family)


@pytest.mark.parametrize("name", ["tiny-granitehybrid", "tiny-granitehybrid_dense"])
def test_native_step_decodes_granite_like_the_torch_layers(tmp_path, name):
    """Granite-4.0-H: Mamba-2 layers on their conv and SSM state slots, rope-less attention
    scaled by `attention.scale`, residual / embedding / logit scales (0.22 / 12 / 6), softmax-
    routed experts with a shared one, or the dense MLP."""
    from tests.engine.tiny_hybrids import VOCAB, write_tiny_hybrid

    path = write_tiny_hybrid(tmp_path, name)
    tokens = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    _step_like_torch_layers(path, tokens, name)


def _qwen3next(path, ssm_in: bool = False):
    """A tiny Qwen3-Next (make_qwen3next.py's writer): three Gated DeltaNet layers (two value
    heads a key head) and one gated attention layer (partial rope, per-head q / k norms), 8
    softmax-routed experts with the block's sigmoid-gated shared one, Q8_0; `ssm_in`: the older
    conversions' one projection of q k v z grouped per key head."""
    from tests.perf import make_qwen3next as q3n

    q3n.write(path, q3n.TINY, "Q8_0", Path(__file__).parents[1] / "data/families/qwen3next.gguf",
              seed=4, ssm_in=ssm_in)  # fmt: skip
    return path


def test_native_step_decodes_qwen3next_like_the_torch_layers(tmp_path):
    path = _qwen3next(tmp_path / "qwen3next.gguf")
    tokens = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    _step_like_torch_layers(path, tokens, "qwen3next")


@pytest.mark.parametrize("ssm_in", [False, True])
def test_first_qwen3next_steps_equal_the_torch_layers(tmp_path, ssm_in):
    """The step's first three teacher-forced decode steps give the torch layers' logits to
    float32 rounding (both quantize each linear's input to int8 alike, and tiny float
    differences vanish in that rounding: measured equal bits): the DeltaNet mixer, the query
    gates and the shared expert's gate each move them by far more where wrong (a query gate
    pinned at 0.5 does, which the KL test above cannot see: this model's gates sit near 0).
    Later steps are not compared: one int8 rounding flip, carried by the recurrent state, moves
    them by ~0.05. Also an older file's one `ssm_in` (q k v z grouped per key head), which the
    step reorders and the torch layers split their own way."""
    path = _qwen3next(tmp_path / "qwen3next.gguf", ssm_in)
    tokens = torch.randint(3, 500, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    native, ran = _logits(path, tokens, 5, native=True)
    assert ran, "the native step did not take the model"
    torch_layers, _ = _logits(path, tokens, 5, native=False)
    err, scale = (native - torch_layers).abs().max().item(), torch_layers.abs().max().item()
    assert err <= 1e-5 * scale, (err, scale)


def _hybrid(tmp_path, name: str):
    """(path, vocabulary) of a tiny hybrid: Granite-4.0-H's or Qwen3-Next's."""
    if name == "qwen3next":
        return _qwen3next(tmp_path / "qwen3next.gguf"), 500
    from tests.engine.tiny_hybrids import VOCAB, write_tiny_hybrid

    return write_tiny_hybrid(tmp_path, "tiny-granitehybrid"), VOCAB


@pytest.mark.parametrize("name", ["granitehybrid", "qwen3next"])
@torch.inference_mode()
def test_hybrid_rows_in_other_slots_step_as_alone(tmp_path, name):
    """Four sequences in state slots 3, 0, 2, 1 decode two steps together in the native step:
    each row's logits are the very bits of its sequence stepping alone in slot 0 (every stage
    of the step works row by row; Granite's Mamba-2 rows and Qwen3-Next's DeltaNet rows on their
    own slots)."""
    path, vocab = _hybrid(tmp_path, name)
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 5, 17, 12)]
    nxt = torch.randint(3, vocab, (2, 4), generator=g).tolist()
    with open_gguf(str(path)) as gguf:
        model = build_model(gguf)

        def run(rows: list[int], slots: list[int]) -> list[torch.Tensor]:
            """The prompts of `rows` one by one into their slots, then two decode steps of them
            together: the logits of each step."""
            layers, kvh, hd = model.kv_shape()
            kv = PagedKVCache(layers, 4 * 3, BS, kvh, hd, "f32", "cpu", model.kv_value_dim())
            attach_states(kv, model, 4)
            tables = [tuple(range(3 * j, 3 * j + 3)) for j in range(len(rows))]
            for j, i in enumerate(rows):
                n = len(seqs[i])
                b = BatchMeta.from_tables([n], [n], [tables[j]], BS)
                b = dataclasses.replace(b, state_slots=(slots[j],))
                model(torch.tensor(seqs[i]), torch.arange(n), b, kv)
            out = []
            for k in range(2):
                lens = [len(seqs[i]) + k + 1 for i in rows]
                b = BatchMeta.from_tables([1] * len(rows), lens, tables, BS)
                b = dataclasses.replace(b, state_slots=tuple(slots))
                ids = torch.tensor([nxt[k][i] for i in rows])
                out.append(model.logits(model(ids, torch.tensor(lens) - 1, b, kv)))
            assert model._native_step._step is not None, "the native step did not take it"
            return out

        together = run([0, 1, 2, 3], [3, 0, 2, 1])
        for i in range(4):
            alone = run([i], [0])
            for k in range(2):
                assert torch.equal(together[k][i], alone[k][0]), (i, k)


def test_nope_layers_are_not_rotated(tmp_path):
    """SmolLM3 with its NoPE layer rotated would be a different model: the step must not be."""
    spec = FAMILIES["smollm3"]
    path = write_tiny_gguf(tmp_path / "smollm3.gguf", spec, quant=True, seed=3)
    as_llama = write_tiny_gguf(
        tmp_path / "llama.gguf", dataclasses.replace(spec, arch="llama"), quant=True, seed=3
    )
    tokens = list(range(3, 43))
    nope, _ = _logits(path, tokens, 5, native=True)
    rotated, _ = _logits(as_llama, tokens, 5, native=True)
    exact, _ = _logits(path, tokens, 5, native=False, precise=True)
    assert _kl(exact, rotated) > 5 * _kl(exact, nope), (_kl(exact, rotated), _kl(exact, nope))


def test_qwen2_lora_steps_run_natively(tmp_path, monkeypatch):
    """Adapters on Qwen2's biased q|k|v (and every other linear): the step takes the LoRA steps,
    no further from exact math than the torch layers, far closer than the base is."""
    spec = FAMILIES["qwen2"]
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", spec, quant=True, seed=3)
    make(argparse.Namespace(model=str(path), out=str(tmp_path), rank=4, count=1))
    adapters = [LoraSpec(str(tmp_path / "lora-0.gguf"))]
    tables, real = [], decode_lora.set_table
    monkeypatch.setattr(decode_lora, "set_table", lambda lib, t: (tables.append(t), real(lib, t)))
    tokens = torch.randint(3, spec.vocab, (30,), generator=torch.Generator().manual_seed(1))
    run = (tokens.tolist(), 5)
    native, ran = _logits(path, *run, native=True, adapters=adapters)
    assert ran and any(t is not None for t in tables), "the LoRA steps did not run natively"
    torch_int8, _ = _logits(path, *run, native=False, adapters=adapters)
    exact, _ = _logits(path, *run, native=False, precise=True, adapters=adapters)
    base, _ = _logits(path, *run, native=False, precise=True)
    kl_native, kl_torch = _kl(exact, native), _kl(exact, torch_int8)
    print(f"qwen2 + LoRA: KL to exact: native {kl_native:.2e}, torch layers {kl_torch:.2e}")
    assert kl_native < 1.5 * kl_torch + 1e-5, (kl_native, kl_torch)
    assert _kl(exact, base) > 10 * kl_native, (_kl(exact, base), kl_native)
