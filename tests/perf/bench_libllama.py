"""llama-bench's pp / tg figures from llama.cpp's library when no llama-bench binary is at hand: a
small C loop built against `libllama` (the `--lib` folder of a llama.cpp build, its headers from
`--llama-cpp`). pp N: one batch of N tokens into a fresh context, timed; tg N: N single-token
decodes after one token, timed. Random token ids (seed 0), best-of and mean of `-r` runs,
printed as a llama-bench-style table.

    python tests/perf/bench_libllama.py --llama-cpp TREE --lib BUILD/bin -m FILE -p 64 -n 16 -t 1
"""

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

PROGRAM = r"""
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* model n_prompt n_gen threads reps: per rep, prints "pp <t/s>" and "tg <t/s>" */
int main(int argc, char ** argv) {
    int np = atoi(argv[2]), ng = atoi(argv[3]), nt = atoi(argv[4]), reps = atoi(argv[5]);
    llama_backend_init();
    struct llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 3;
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = np + ng + 8; cp.n_batch = cp.n_ctx; cp.n_ubatch = cp.n_ctx;
    cp.n_threads = nt; cp.n_threads_batch = nt; cp.n_seq_max = 1;
    struct llama_batch b = llama_batch_init(np > 1 ? np : 1, 0, 1);
    srand(0);
    for (int r = 0; r <= reps; r++) {  /* run 0: warm-up */
        struct llama_context * ctx = llama_init_from_model(model, cp);
        if (np) {
            for (int i = 0; i < np; i++) {
                b.token[i] = rand() % nv; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0;
                b.logits[i] = i == np - 1;
            }
            b.n_tokens = np;
            double t0 = now();
            if (llama_decode(ctx, b)) return 5;
            llama_synchronize(ctx);
            if (r) printf("pp %f\n", np / (now() - t0));
            llama_memory_clear(llama_get_memory(ctx), 1);
        }
        if (ng) {
            double t0 = 0;
            for (int i = 0; i <= ng; i++) {  /* the first token opens the sequence, untimed */
                if (i == 1) t0 = now();
                b.token[0] = rand() % nv; b.pos[0] = i; b.n_seq_id[0] = 1; b.seq_id[0][0] = 0;
                b.logits[0] = 1; b.n_tokens = 1;
                if (llama_decode(ctx, b)) return 6;
                llama_synchronize(ctx);
            }
            if (r) printf("tg %f\n", ng / (now() - t0));
        }
        llama_free(ctx);
    }
    llama_batch_free(b);
    llama_model_free(model);
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the llama.cpp source tree")
    ap.add_argument("--lib", type=Path, required=True, help="folder with its built libllama.so")
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "bench.c", Path(d) / "bench"
        src.write_text(PROGRAM, encoding="utf-8")
        inc = [f"-I{a.llama_cpp}/include", f"-I{a.llama_cpp}/ggml/include"]
        cmd = ["cc", "-O2", str(src), "-o", str(exe), *inc, f"-L{a.lib}", "-lllama",
               f"-Wl,-rpath,{a.lib}"]  # fmt: skip
        subprocess.run(cmd, check=True)
        run = [str(exe), str(a.model), str(a.p), str(a.n), str(a.threads), str(a.repetitions)]
        out = subprocess.run(run, check=True, capture_output=True, text=True).stdout
    rates: dict[str, list[float]] = {}
    for line in out.splitlines():
        kind, value = line.split()
        rates.setdefault(kind, []).append(float(value))
    print("| model | backend | threads | test | t/s |\n| --- | --- | ---: | ---: | ---: |")
    for kind, n in (("pp", a.p), ("tg", a.n)):
        if kind in rates:
            v = rates[kind]
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            print(f"| {a.model.name} | llama.cpp CPU (libllama) | {a.threads} | {kind}{n} | "
                  f"{statistics.mean(v):.2f} ± {sd:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
