"""`granitehybrid.FUSED_RESIDUAL` (llama's block layout for Granite 4.0-H: the residual adds,
times residual_scale, in the next norm; the norms' int8 rows to the linears; q|k|v fused)
against the plain blocks, on the converted fixtures (tests/data/families, MoE with a shared
expert and the dense variant): the same hidden states, bit for bit, for a prompt and for a chunk
after it (the torch layers run the plain blocks' very ops); the fixtures' residual scale is not
1, so a dropped scale fails. The CUDA norm's scale is tested in tests/kernels/test_fused.py; on a
GPU the engine's greedy tokens with the switch on and off agree (near-tie rule)."""

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.models import granitehybrid
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states
from tests.engine.family_goldens import path

BS = 16


def _hidden(name: str) -> tuple[list[torch.Tensor], float]:
    """Hidden states of a 21-token prompt, then of 12 tokens after it (state and KV carried)."""
    with open_gguf(str(path(name))) as gg:
        model = build_model(gg, precise=True, device="cpu")
        layers, kvh, hd = model.kv_shape()
        kv = PagedKVCache(layers, 4, BS, kvh, hd, "f32", "cpu", model.kv_value_dim())
        attach_states(kv, model, 1)
        ids = torch.randint(
            0, model.args.vocab_size, (33,), generator=torch.Generator().manual_seed(5)
        )
        out = []
        with torch.inference_mode():
            for start, end in ((0, 21), (21, 33)):
                meta = BatchMeta.contiguous(end - start, end, BS)
                out.append(model(ids[start:end], torch.arange(start, end), meta, kv).clone())
        return out, model.args.residual_scale


@pytest.mark.parametrize("name", ["granitehybrid", "granitehybrid_dense"])
def test_fused_blocks_equal_the_plain_ones(name, monkeypatch):
    plain, scale = _hidden(name)
    assert scale != 1.0
    monkeypatch.setattr(granitehybrid, "FUSED_RESIDUAL", True)
    fused, _ = _hidden(name)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["tiny-granitehybrid", "tiny-granitehybrid_dense"])
def test_engine_tokens_same_with_fused_blocks_on_a_gpu(tmp_path, name, monkeypatch):
    """On the tiny Q4_K synthetics (the norms' int8 rows and fused q|k|v engage; decode graphs):
    greedy tokens of a batch of three with the switch on and off agree up to a near-tie of the
    precise reference."""
    import gc

    from localllm.engine import LLM, SamplingParams
    from tests.engine.near_ties import assert_same_or_near_tie
    from tests.engine.tiny_hybrids import write_tiny_hybrid

    p = write_tiny_hybrid(tmp_path, name)
    base = [(37 * i + 11) % 500 for i in range(40)]
    prompts = [base, base[::-1][:23], (base * 2)[:57]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = {}
    for flag in (False, True):
        monkeypatch.setattr(granitehybrid, "FUSED_RESIDUAL", flag)
        llm = LLM(str(p), device="cuda", max_model_len=256, block_size=BS)
        out[flag] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert_same_or_near_tie(p, prompts, out[True], out[False])
