"""`granitehybrid.FUSED_RESIDUAL` (llama's block layout for Granite 4.0-H: the residual adds,
times residual_scale, in the next norm; the norms' int8 rows to the linears; q|k|v fused)
against the plain blocks, on the converted fixtures (tests/data/families, MoE with a shared
expert and the dense variant): the same hidden states, bit for bit, for a prompt and for a chunk
after it (the torch layers run the plain blocks' very ops); the fixtures' residual scale is not
1, so a dropped scale fails. The CUDA norm's scale is tested in tests/kernels/test_fused.py; on a
GPU the engine's greedy tokens with the switch on and off agree (near-tie rule)."""

import pytest
import torch

from localllm.engine.models import granitehybrid
from tests.engine.fused_blocks import assert_gpu_tokens_same_with_switch, hidden_states


@pytest.mark.parametrize("name", ["granitehybrid", "granitehybrid_dense"])
def test_fused_blocks_equal_the_plain_ones(name, monkeypatch):
    monkeypatch.setattr(granitehybrid, "FUSED_RESIDUAL", False)  # (whatever the default)
    plain, args = hidden_states(name)
    assert args.residual_scale != 1.0
    monkeypatch.setattr(granitehybrid, "FUSED_RESIDUAL", True)
    fused, _ = hidden_states(name)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["tiny-granitehybrid", "tiny-granitehybrid_dense"])
def test_engine_tokens_same_with_fused_blocks_on_a_gpu(tmp_path, name, monkeypatch):
    assert_gpu_tokens_same_with_switch(tmp_path, name, granitehybrid, "FUSED_RESIDUAL", monkeypatch)
