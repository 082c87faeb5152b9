"""What the fused-block switches' tests share (`lfm2.FUSED_RESIDUAL`,
`granitehybrid.FUSED_RESIDUAL`): a converted fixture's hidden states for a prompt and a chunk
after it, and the engine's greedy tokens on a GPU with a switch on and off."""

import gc

import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states
from tests.engine.family_goldens import path

BS = 16


def hidden_states(name: str) -> tuple[list[torch.Tensor], object]:
    """(hidden states of a 21-token prompt, then of 12 tokens after it with state and KV carried;
    the model's args), on the CPU's precise torch layers."""
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
        return out, model.args


def assert_gpu_tokens_same_with_switch(tmp_path, name: str, module, switch: str, monkeypatch):
    """On a tiny Q4_K synthetic (tests/engine/tiny_hybrids.py; the int8 rows and decode graphs
    engage): greedy tokens of a batch of three with `module.switch` on and off agree up to a
    near-tie of the precise reference."""
    from localllm.engine import LLM, SamplingParams
    from tests.engine.near_ties import assert_same_or_near_tie
    from tests.engine.tiny_hybrids import write_tiny_hybrid

    p = write_tiny_hybrid(tmp_path, name)
    base = [(37 * i + 11) % 500 for i in range(40)]
    prompts = [base, base[::-1][:23], (base * 2)[:57]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = {}
    for flag in (False, True):
        monkeypatch.setattr(module, switch, flag)
        llm = LLM(str(p), device="cuda", max_model_len=256, block_size=BS)
        out[flag] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert_same_or_near_tie(p, prompts, out[True], out[False])
