"""Graph replay against eager decode, per flash-decoding split and combine quantization (GPU).

Not a test: a probe for tests/engine/test_gpu_graphs.py::test_graph_replay_equals_eager_decode,
which on an H100 (2026-12-06 12:18 UTC, span split) saw 9 of 24,576 logits more than its 0.02
apart (max 0.032). It prints, for the chunk and span splits with and without the combine's
quantized output rows, the largest logit difference over the test's 48 teacher-forced steps and
whether greedy tokens agree where eager's top two are clear, to tell the split's own error from
int8 rounding flips in the linears' activations: the test's Q4_K_M file, then an F16 file of the
same shape with float32 activations (no int8 rounding)::

    python tests/perf/graph_replay_diff.py        (from the repo root, on a CUDA machine)
"""

import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import test_gpu_graphs as t
import torch

from localllm.kernels.attention import triton_decode as td


def main() -> None:
    from localllm.kernels.quant import linear

    root = Path(tempfile.mkdtemp())
    files = {}
    for ftype in ("Q4_K_M", "F16"):
        files[ftype] = root / f"{ftype}.gguf"
        shape = dataclasses.replace(t.SHAPES["tiny"], vocab=512)
        t.write_synthetic(files[ftype], shape, ftype, None, seed=1)
    # the test's Q4_K_M file (int8 activations into its packed GEMVs), then the same shape drawn
    # as F16 with float32 activations (HALF_GEMM off): no int8 rounding to flip
    runs = [("Q4_K_M", k, q) for k in ("chunk", "span") for q in (True, False)]
    runs += [("F16", k, False) for k in ("chunk", "span")]
    for ftype, kernel, quant in runs:
        linear.HALF_GEMM = ftype == "Q4_K_M"
        td.SPLIT_KERNEL, td.COMBINE_QUANT = kernel, quant
        eager, got = t._compare(files[ftype], "cuda", replay=True)
        d = (got - eager).abs()
        top2 = eager.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.08
        same = torch.equal(got.argmax(-1)[clear], eager.argmax(-1)[clear])
        print(
            f"{ftype}, {kernel} split, combine quant {quant}: max |diff| {d.max():.4f}, "
            f"{(d > 0.02).sum().item()} over 0.02; greedy equal where clear "
            f"({clear.sum().item()} of {len(clear)} steps): {same}",
            flush=True,
        )


if __name__ == "__main__":
    main()
