"""MoE residency of a Hugging Face folder on CUDA (marked `gpu`): the committed GLM-4.5-shaped
folder (tests/data/hf/glm4moe, bf16) quantized at load to Q8_0, through the engine on the GPU:
experts on host copied to the GPU per use, and streamed from the folder's spill file (one slot a
layer, and room for a step's experts) give the all-on-device run's greedy tokens exactly (the
GPU's kernels over the same bytes), and the disk runs hold no expert blocks on the device."""

import shutil
from pathlib import Path

import pytest
import torch

from localllm.engine import LLM, SamplingParams
from localllm.engine.moe.block import account_mapped, moe_blocks
from localllm.offload.expert_stats import expert_stats
from localllm.offload.residency import resolve

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FOLDER = Path(__file__).parents[1] / "data" / "hf" / "glm4moe"
PROMPTS = [[1, 5, 9, 33, 7, 11], [200, 3, 3, 17]]
MODES = (
    {"cpu_moe": True, "host_compute": "device"},  # host blocks copied over per use
    {"experts": "disk", "streaming": {"slots": 2}},
    {"experts": "disk", "streaming": {"slots": 8}},
)


def _greedy(folder: Path, layer: dict | None):
    cfg = None if layer is None else resolve([("test", layer)])
    llm = LLM(str(folder), quantize="q8_0", max_model_len=128, device="cuda", residency=cfg)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    return out, llm.engine.model


def test_cuda_folder_residency_token_exact(tmp_path):
    folder = shutil.copytree(FOLDER, tmp_path / "glm4moe")  # (its spill file goes there too)
    want, model = _greedy(folder, None)
    assert moe_blocks(model)[0].ffn_gate_exps.weight.data.device.type == "cuda"
    for layer in MODES:
        got, model = _greedy(folder, layer)
        assert got == want, layer
        tiers = set(model.residency_plan.expert_tiers().values())
        account_mapped(model)
        stats = expert_stats(model.expert_sources)
        assert stats.lookups == stats.hits + stats.misses > 0, layer
        if tiers == {"disk"}:
            assert all(b.ffn_gate_exps.weight is None for b in moe_blocks(model)), layer
            assert stats.misses > 0, layer
