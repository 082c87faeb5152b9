"""`lfm2.FUSED_RESIDUAL` (llama's block layout for LFM2 and LFM2-MoE: residual adds in the next
norm, the norms' int8 rows to the linears, q|k|v fused, an MoE's rows summed in the next norm)
against the plain blocks, on the converted fixtures (tests/data/families): the same hidden
states for a prompt and for a chunk after it (the torch layers; the CUDA kernels it hands work to
are llama's, tested there)."""

import pytest
import torch

from localllm.engine.models import lfm2
from tests.engine.fused_blocks import assert_gpu_tokens_same_with_switch, hidden_states


@pytest.mark.parametrize("name", ["lfm2", "lfm2moe"])
def test_fused_blocks_equal_the_plain_ones(name, monkeypatch):
    monkeypatch.setattr(lfm2, "FUSED_RESIDUAL", False)  # (whatever the default)
    plain, _ = hidden_states(name)
    monkeypatch.setattr(lfm2, "FUSED_RESIDUAL", True)
    fused, _ = hidden_states(name)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2moe"])
def test_engine_tokens_same_with_fused_blocks_on_a_gpu(tmp_path, name, monkeypatch):
    """On the tiny Q4_K synthetics (the norms' int8 rows, fused q|k|v and the attention's
    quantized rows engage; decode graphs)."""
    assert_gpu_tokens_same_with_switch(tmp_path, name, lfm2, "FUSED_RESIDUAL", monkeypatch)
