"""Where the Triton kernel tests run: on a CUDA device (marked `gpu`) or on CPU tensors under
TRITON_INTERPRET=1 (with triton installed); skipped elsewhere (CI has no triton)."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    not (CUDA or INTERPRET), reason="needs a CUDA device (or TRITON_INTERPRET=1 with triton)"
)
TRITON_MARKS = [pytest.mark.gpu, needs_triton]  # a module's pytestmark
