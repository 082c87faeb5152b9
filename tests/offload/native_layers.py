"""Shared by the tests of the split's CPU side: the native kernels (for a module fixture), and a
random MoE layer of raw GGUF expert blocks in Qwen3-30B-A3B Q4_K_M's type mix."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.kernels.cpu import native
from tests.perf.make_synthetic import random_rows

TYPES = (QT.Q4_K, QT.Q4_K, QT.Q6_K)  # gate, up, down


def native_kernels(tmp_path_factory) -> native.NativeKernels:
    """The native kernels built into a fresh directory; the test is skipped without a compiler."""
    k = native.load(tmp_path_factory.mktemp("native"))
    if k is None:
        pytest.skip("no C compiler here")
    return k


def random_layer(n_expert=12, dim=256, hidden=512, seed=0):
    """(gate [E, hidden, rb], up [E, hidden, rb], down [E, dim, rb]) uint8 block tensors."""
    rng = np.random.default_rng(seed)
    shapes = ((hidden, dim), (hidden, dim), (dim, hidden))
    return tuple(
        torch.from_numpy(np.stack([random_rows(TYPES[i], r, c, rng) for _ in range(n_expert)]))
        for i, (r, c) in enumerate(shapes)
    )
