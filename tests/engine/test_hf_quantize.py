"""`--quantize q4_k`: our numpy port of ggml's `quantize_row_q4_K_ref` gives its blocks bit for
bit (recorded from the C reference by tests/tools/record_q4_k_blocks.py: gaussian rows at
several scales, zeros, a constant, outliers, non-negative and tiny values), and a folder
quantized to Q4_K at load holds those blocks."""

from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.engine.hf import open_hf
from localllm.engine.hf.quantize import quantize
from localllm.engine.hf.quantize_k import quantize_q4_k
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.dequant import dequantize

DATA = Path(__file__).parents[1] / "data" / "hf"


def test_q4_k_blocks_equal_ggml_reference():
    z = np.load(DATA / "q4_k_blocks.npz")
    got = quantize_q4_k(z["rows"])
    assert got.shape == z["blocks"].shape
    bad = [i for i in range(len(got)) if not np.array_equal(got[i], z["blocks"][i])]
    assert not bad, f"rows {bad} differ from ggml's blocks"


def test_q4_k_chunks_and_dtypes_do_not_change_the_blocks():
    """Through `quantize` (row chunks, a bf16 tensor): the same blocks as one call on float32."""
    from localllm.engine.hf import quantize as q

    x = torch.randn(40, 512, dtype=torch.bfloat16)
    want = quantize_q4_k(x.float().numpy())
    old = q.CHUNK_VALUES
    try:
        q.CHUNK_VALUES = 512 * 3  # three rows per chunk: chunk edges inside the tensor
        got = quantize(x, QuantType.Q4_K).numpy()
    finally:
        q.CHUNK_VALUES = old
    assert np.array_equal(got, want)
    err = dequantize(torch.from_numpy(got), QuantType.Q4_K).reshape(x.shape) - x.float()
    assert (err.norm() / x.float().norm()).item() < 0.1  # ~7 % for gaussian rows, as ggml's


def test_folder_quantized_to_q4_k_at_load(tmp_path):
    """A 256-wide folder (narrower rows are not whole Q4_K blocks and would stay bf16): its
    linears load as Q4_K blocks within ggml's usual error of the weights."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from tests.engine.hf_fixtures import save_tiny

    d = save_tiny("qwen3", tmp_path / "q", width=256)
    with open_hf(d, quantize="q4_k") as ck:
        types = {ck.tensors[n].qtype.name for n in ck.tensors if n.endswith("ffn_up.weight")}
        assert types == {"Q4_K"}
        w = ck.weight("blk.0.ffn_up.weight")
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    exact = ref.model.layers[0].mlp.up_proj.weight
    err = (dequantize(w.data, QuantType.Q4_K).reshape(w.shape) - exact).norm() / exact.norm()
    assert err.item() < 0.1


def test_q4_k_falls_back_to_q8_0_for_rows_of_partial_blocks():
    """Rows of 32 or 64 values (the committed tiny folder) are not whole 256-value blocks: they
    take Q8_0, which the CPU kernels run on its blocks (llama-quantize would take Q5_0)."""
    with open_hf(DATA / "llama", quantize="q4_k") as ck:
        types = {t.qtype.name for n, t in ck.tensors.items() if n.startswith("blk.")}
    assert types == {"Q8_0", "F32"}  # linears Q8_0, norms float32
