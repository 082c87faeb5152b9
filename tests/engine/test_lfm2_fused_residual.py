"""`lfm2.FUSED_RESIDUAL` (llama's block layout for LFM2 and LFM2-MoE: residual adds in the next
norm, the norms' int8 rows to the linears, q|k|v fused, an MoE's rows summed in the next norm)
against the plain blocks, on the converted fixtures (tests/data/families): the same hidden
states for a prompt and for a chunk after it (the torch layers; the CUDA kernels it hands work to
are llama's, tested there)."""

import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.models import lfm2
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states
from tests.engine.family_goldens import path

BS = 16


def _hidden(name: str) -> list[torch.Tensor]:
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
        return out


@pytest.mark.parametrize("name", ["lfm2", "lfm2moe"])
def test_fused_blocks_equal_the_plain_ones(name, monkeypatch):
    plain = _hidden(name)
    monkeypatch.setattr(lfm2, "FUSED_RESIDUAL", True)
    fused = _hidden(name)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2moe"])
def test_engine_tokens_same_with_fused_blocks_on_a_gpu(tmp_path, name, monkeypatch):
    """On the tiny Q4_K synthetics (the norms' int8 rows, fused q|k|v and the attention's
    quantized rows engage; decode graphs): greedy tokens of a batch of three with the switch on
    and off agree up to a near-tie of the precise reference."""
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
        monkeypatch.setattr(lfm2, "FUSED_RESIDUAL", flag)
        llm = LLM(str(p), device="cuda", max_model_len=256, block_size=BS)
        out[flag] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert_same_or_near_tie(p, prompts, out[True], out[False])
