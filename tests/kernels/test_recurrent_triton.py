"""The triton decode steps of the recurrent layers (`kernels/recurrent/triton_recurrent.py`)
against their torch references (`decode.py`), on CUDA (marked gpu) or on CPU tensors under
TRITON_INTERPRET=1 with triton installed: outputs and the slots' new state, other slots
untouched, a fresh sequence's garbage never read."""

import pytest
import torch

from localllm.kernels.recurrent.decode import conv_decode_ref, gated_delta_decode_ref
from tests.kernels.test_recurrent_decode import EPS, SHAPES, TOL, conv_inputs, delta_inputs
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


@pytest.mark.parametrize("shape", SHAPES)
def test_delta_decode_matches_reference(shape):
    from localllm.kernels.recurrent.triton_recurrent import gated_delta_decode_cuda

    args = delta_inputs(*shape, device=DEVICE, seed=2)
    ref_states = args[5].clone()
    want = gated_delta_decode_ref(*args[:5], ref_states, *args[6:], EPS)
    got = gated_delta_decode_cuda(*args, EPS)
    assert (got - want).abs().max().item() < TOL
    assert torch.allclose(args[5], ref_states, atol=TOL, rtol=0, equal_nan=True)


@pytest.mark.parametrize(("c", "kk"), [(40, 4), (300, 4), (64, 2)])
def test_conv_decode_matches_reference(c, kk):
    from localllm.kernels.recurrent.triton_recurrent import conv_decode_cuda

    x, w, states, slots, fresh = conv_inputs(c, kk, device=DEVICE, seed=3)
    ref_states = states.clone()
    want = conv_decode_ref(x, w, ref_states, slots, fresh)
    got = conv_decode_cuda(x, w, states, slots, fresh)
    assert (got - want).abs().max().item() < TOL
    assert torch.allclose(states, ref_states, atol=TOL, rtol=0, equal_nan=True)
