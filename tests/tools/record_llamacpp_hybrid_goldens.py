"""Record llama.cpp's CPU outputs on the hybrid fixtures (tests/data/families/{lfm2,granitehybrid,
granitehybrid_dense}.gguf), the second reference beside transformers: a small C program against
llama.cpp's own library (`libllama`) runs each file on one thread, (1) the fixture's whole
sequence (prompt + transformers' greedy tokens) in one batch with logits at every position, and
(2) greedy decoding from the prompt, one token a step (llama.cpp's recurrent-state decode path).

    python tests/tools/record_llamacpp_hybrid_goldens.py --llama-cpp /path/to/llama.cpp \\
        --lib /path/to/build/bin   # the folder holding libllama.so (built from that tree)

writes tests/data/families/NAME.llamacpp.json: the teacher-forced logits (base64 float32
[positions, vocab]), llama.cpp's greedy tokens, the tree's commit when known. Never imports
localllm.
"""

from __future__ import annotations

import argparse
import base64
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data" / "families"
NAMES = ["lfm2", "lfm2moe", "granitehybrid", "granitehybrid_dense"]

PROGRAM = r"""
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>

static int argmax(const float * x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[best]) best = i;
    return best;
}

/* model out.bin n_prompt n_greedy ids... : logits of every id in one batch, then greedy tokens
   from the first n_prompt ids, one a step (written after the logits as int32) */
int main(int argc, char ** argv) {
    if (argc < 6) return 2;
    int n_prompt = atoi(argv[3]), n_greedy = atoi(argv[4]), n = argc - 5;
    llama_backend_init();
    struct llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 3;
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + n_greedy + 8; cp.n_batch = cp.n_ctx; cp.n_ubatch = cp.n_ctx;
    cp.n_threads = 1; cp.n_threads_batch = 1; cp.n_seq_max = 1;
    FILE * f = fopen(argv[2], "wb");
    struct llama_batch b = llama_batch_init(n + n_greedy, 0, 1);
    for (int pass = 0; pass < 2; pass++) {
        struct llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) return 4;
        int m = pass == 0 ? n : n_prompt;
        for (int i = 0; i < m; i++) {
            b.token[i] = atoi(argv[5 + i]); b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0;
            b.logits[i] = pass == 0 || i == m - 1;
        }
        b.n_tokens = m;
        if (llama_decode(ctx, b)) return 5;
        if (pass == 0) {
            for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), nv, f);
        } else {
            for (int k = 0; k < n_greedy; k++) {
                int tok = argmax(llama_get_logits_ith(ctx, -1), nv);
                fwrite(&tok, sizeof(int), 1, f);
                b.token[0] = tok; b.pos[0] = m + k; b.n_seq_id[0] = 1; b.seq_id[0][0] = 0;
                b.logits[0] = 1; b.n_tokens = 1;
                if (llama_decode(ctx, b)) return 6;
            }
        }
        llama_free(ctx);
    }
    fclose(f);
    llama_batch_free(b);
    llama_model_free(model);
    return 0;
}
"""


def build(llama_cpp: Path, lib: Path, tmp: Path) -> Path:
    src, exe = tmp / "goldens.c", tmp / "goldens"
    src.write_text(PROGRAM, encoding="utf-8")
    cmd = ["cc", "-O2", str(src), "-o", str(exe), f"-I{llama_cpp}/include",
           f"-I{llama_cpp}/ggml/include", f"-L{lib}", "-lllama", f"-Wl,-rpath,{lib}"]  # fmt: skip
    subprocess.run(cmd, check=True)
    return exe


def record(exe: Path, name: str, tmp: Path, meta: dict) -> Path:
    golden = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
    prompt, greedy = golden["prompt"]["ids"], golden["greedy_ids"]
    seq = prompt + greedy
    out = tmp / f"{name}.bin"
    cmd = [str(exe), str(DATA / f"{name}.gguf"), str(out), str(len(prompt)), str(len(greedy))]
    subprocess.run([*cmd, *map(str, seq)], check=True, capture_output=True)
    raw = out.read_bytes()
    vocab = (len(raw) - 4 * len(greedy)) // (4 * len(seq))
    logits = np.frombuffer(raw[: 4 * vocab * len(seq)], dtype=np.float32).reshape(len(seq), vocab)
    tokens = np.frombuffer(raw[4 * vocab * len(seq) :], dtype=np.int32).tolist()
    path = DATA / f"{name}.llamacpp.json"
    body = {
        "recorder": {"script": "tests/tools/record_llamacpp_hybrid_goldens.py", **meta},
        "sequence": seq,
        "n_prompt": len(prompt),
        "logits": {
            "shape": list(logits.shape),
            "dtype": "float32",
            "base64": base64.b64encode(logits.tobytes()).decode("ascii"),
        },
        "greedy_ids": tokens,
    }
    path.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the llama.cpp source tree")
    ap.add_argument("--lib", type=Path, required=True, help="folder with its built libllama.so")
    ap.add_argument("--commit", help="the tree's commit, when it is no git checkout")
    args = ap.parse_args()
    meta = {
        "llama_cpp_commit": args.commit,
        "threads": 1,
        "backend": "CPU",
        "python": platform.python_version(),
    }
    with tempfile.TemporaryDirectory() as d:
        exe = build(args.llama_cpp, args.lib, Path(d))
        for name in NAMES:
            print(f"wrote {record(exe, name, Path(d), meta)}", file=sys.stderr)


if __name__ == "__main__":
    main()
