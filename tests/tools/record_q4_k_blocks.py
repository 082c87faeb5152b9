"""Record tests/data/hf/q4_k_blocks.npz: rows and ggml's own Q4_K blocks of them.

The reference is `quantize_row_q4_K_ref` from llama.cpp's ggml/src/ggml-quants.c, with the two
helpers it calls (`nearest_int`, `make_qkx2_quants`), cut out of the checkout by name and built
with a small harness (`cc -O2 -ffp-contract=off`: no fused multiply-adds, the float32 arithmetic
as written). tests/engine/test_hf_quantize.py checks that `engine/hf/quantize_k.py` gives the same
blocks, bit for bit, without llama.cpp in CI.

    python tests/tools/record_q4_k_blocks.py --llama-cpp /path/to/llama.cpp

Rows: gaussian rows at several scales, a row of zeros, a constant row, rows with one large
outlier per sub-block, non-negative rows, tiny values (fp16 subnormal scales), 16 x 512 values.
"""

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

OUT = Path("tests/data/hf/q4_k_blocks.npz")
HARNESS = r"""
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdbool.h>
#define GGML_RESTRICT
#define QK_K 256
#define K_SCALE_SIZE 12
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
typedef _Float16 ggml_half;
typedef struct {
    ggml_half d; ggml_half dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K/2];
} block_q4_K;
#define GGML_FP32_TO_FP16(x) ((_Float16)(x))
#define GGML_FP16_TO_FP32(x) ((float)(x))
%s
int main(int argc, char ** argv) {
    long n = atol(argv[1]), k = atol(argv[2]);
    float * x = malloc(n * k * sizeof(float));
    fread(x, sizeof(float), n * k, stdin);
    block_q4_K * y = malloc(n * (k / QK_K) * sizeof(block_q4_K));
    for (long r = 0; r < n; r++) quantize_row_q4_K_ref(x + r * k, y + r * (k / QK_K), k);
    fwrite(y, sizeof(block_q4_K), n * (k / QK_K), stdout);
    return 0;
}
"""
FUNCTIONS = ("static inline int nearest_int", "static float make_qkx2_quants",
             "static inline void get_scale_min_k4", "void quantize_row_q4_K_ref")  # fmt: skip


def extract(source: str, signature: str) -> str:
    """The C function starting with `signature`, through its closing brace at column 0."""
    start = source.index(signature)
    end = re.compile(r"^}\n", re.M).search(source, start).end()
    return source[start:end]


def rows() -> np.ndarray:
    rng = np.random.default_rng(36)
    out = [rng.standard_normal(512) * s for s in (1.0, 0.02, 30.0)]
    out.append(np.zeros(512))
    out.append(np.full(512, 0.25))
    spiky = rng.standard_normal(512) * 0.1
    spiky[::32] = 8.0
    out.append(spiky)
    out.append(np.abs(rng.standard_normal(512)))
    out.append(rng.standard_normal(512) * 1e-6)
    out.extend(rng.standard_normal((8, 512)) * rng.uniform(0.01, 2.0, (8, 1)))
    return np.stack(out).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp checkout")
    args = ap.parse_args()
    source = (args.llama_cpp / "ggml" / "src" / "ggml-quants.c").read_text()
    code = HARNESS % "\n".join(extract(source, f) for f in FUNCTIONS)
    x = rows()
    with tempfile.TemporaryDirectory() as tmp:
        c, exe = Path(tmp) / "q4k.c", Path(tmp) / "q4k"
        c.write_text(code)
        subprocess.run(
            ["cc", "-O2", "-ffp-contract=off", "-o", str(exe), str(c), "-lm"], check=True
        )
        res = subprocess.run([str(exe), str(x.shape[0]), str(x.shape[1])], input=x.tobytes(),
                             capture_output=True, check=True)  # fmt: skip
    blocks = np.frombuffer(res.stdout, np.uint8).reshape(x.shape[0], -1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, rows=x, blocks=blocks)


if __name__ == "__main__":
    main()
