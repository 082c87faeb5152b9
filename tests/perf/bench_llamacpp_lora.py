"""Decode with LoRA adapters, ours next to llama.cpp's, with the very same GGUF LoRA files
(issue 36). Not a test.

    python tests/perf/bench_llamacpp_lora.py make --base HF_FOLDER --llama-cpp TREE --out DIR
    python tests/perf/bench_llamacpp_lora.py run --model BASE.gguf --dir DIR \
        --llama-cpp TREE --lib BUILD/bin [-n 64 --reps 3 --rounds 3 -t 2 --device cpu]

`make` writes K PEFT adapters of a Hugging Face base folder (`get_peft_model`,
`init_lora_weights=False`: A and B random, fixed seeds; rank 16, alpha 16 on q/k/v/o and the
MLP) to DIR/peft-K and converts each with llama.cpp's own `convert_lora_to_gguf.py --outtype
f16` to DIR/lora-K.gguf (run from the llama.cpp tree given, as tests/tools/record_lora_fixtures.py
does). The base GGUF is llama.cpp's conversion of the same folder (`bench_hf_load.py make`
writes one) or any GGUF whose tensors the adapters name.

`run` alternates, round by round, cases base / 1 adapter / 4 adapters (every token on all of
them, scale 1) for both engines: ours is `localllm bench -p 0 -n N -r REPS --lora ...` in its
own process; llama.cpp's is a small C program built here against its `libllama` (`--lib`, the
headers from `--llama-cpp`): `llama_adapter_lora_init` + `llama_set_adapters_lora` (what
llama-cli and llama-server call for `--lora`), then N single-token decodes timed after one
untimed token, as llama-bench's tg. No llama-server: on random-weight models its completion
path answers HTTP 500 (see tests/perf/results/lora.md), and llama-bench takes no `--lora`.
On a GPU (`--device cuda`) llama.cpp offloads every layer (`n_gpu_layers` 999).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {"base": 0, "1 adapter": 1, "4 adapters": 4}

CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
sys.argv = [root + "/convert_lora_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_lora_to_gguf.py", run_name="__main__")
"""

PROGRAM = r"""
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* model n_gen threads reps ngl [adapter.gguf ...]: per rep (after a warm-up), "tg <t/s>" */
int main(int argc, char ** argv) {
    int ng = atoi(argv[2]), nt = atoi(argv[3]), reps = atoi(argv[4]), ngl = atoi(argv[5]);
    int na = argc - 6;
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 3;
    struct llama_adapter_lora ** ads = calloc(na > 0 ? na : 1, sizeof *ads);
    float * scales = calloc(na > 0 ? na : 1, sizeof *scales);
    for (int i = 0; i < na; i++) {
        ads[i] = llama_adapter_lora_init(model, argv[6 + i]);
        if (!ads[i]) { fprintf(stderr, "adapter %s did not load\n", argv[6 + i]); return 4; }
        scales[i] = 1.0f;
    }
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = ng + 8; cp.n_batch = cp.n_ctx; cp.n_ubatch = cp.n_ctx;
    cp.n_threads = nt; cp.n_threads_batch = nt; cp.n_seq_max = 1;
    struct llama_batch b = llama_batch_init(1, 0, 1);
    srand(0);
    for (int r = 0; r <= reps; r++) {  /* run 0: warm-up */
        struct llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) return 5;
        if (na && llama_set_adapters_lora(ctx, ads, na, scales)) return 6;
        double t0 = 0;
        for (int i = 0; i <= ng; i++) {  /* the first token opens the sequence, untimed */
            if (i == 1) t0 = now();
            b.token[0] = rand() % nv; b.pos[0] = i; b.n_seq_id[0] = 1; b.seq_id[0][0] = 0;
            b.logits[0] = 1; b.n_tokens = 1;
            if (llama_decode(ctx, b)) return 7;
            llama_synchronize(ctx);
        }
        if (r) printf("tg %f\n", ng / (now() - t0));
        fflush(stdout);
        llama_free(ctx);
    }
    llama_batch_free(b);
    llama_model_free(model);
    return 0;
}
"""


def make(a) -> None:
    import peft
    import torch
    import transformers

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float32)
    for k in range(a.count):
        torch.manual_seed(1000 + k)
        cfg = peft.LoraConfig(r=a.rank, lora_alpha=a.rank, target_modules=TARGETS,
                              init_lora_weights=False, lora_dropout=0.0,
                              task_type="CAUSAL_LM")  # fmt: skip
        model = peft.get_peft_model(base, cfg)
        folder = out / f"peft-{k}"
        model.save_pretrained(folder)
        base = model.unload()  # the plain base again, for the next adapter
        cmd = [sys.executable, "-c", CONVERT, str(a.llama_cpp), str(folder), "--base", str(a.base),
               "--outtype", "f16", "--outfile", str(out / f"lora-{k}.gguf")]  # fmt: skip
        subprocess.run(cmd, check=True)
        print(out / f"lora-{k}.gguf")


def _ours(a, adapters: list[str]) -> list[float]:
    cmd = [sys.executable, "-m", "localllm.app", "bench", "-m", a.model, "-p", "0",
           "-n", str(a.n_gen), "-r", str(a.reps), "-o", "json", "--device", a.device,
           "-t", str(a.threads)]  # fmt: skip
    for p in adapters:
        cmd += ["--lora", p]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env(a)).stdout
    return json.loads(out)[0]["samples_ts"]


def _theirs(a, exe: Path, adapters: list[str]) -> list[float]:
    ngl = "999" if a.device != "cpu" else "0"
    cmd = [str(exe), a.model, str(a.n_gen), str(a.threads), str(a.reps), ngl, *adapters]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(a))
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-3:]
        raise SystemExit(f"llama.cpp harness exited {done.returncode}: {' / '.join(tail)}")
    return [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("tg ")]


def _env(a) -> dict[str, str]:
    """The children's environment: OpenMP pools of `-t` threads (a caller's OMP_NUM_THREADS=1
    would hold the native CPU step to one thread)."""
    return {**os.environ, "OMP_NUM_THREADS": str(a.threads)}


def _build(a, where: Path) -> Path:
    src, exe = where / "lora_bench.c", where / "lora_bench"
    src.write_text(PROGRAM, encoding="utf-8")
    inc = [f"-I{a.llama_cpp}/include", f"-I{a.llama_cpp}/ggml/include"]
    cmd = ["cc", "-O2", str(src), "-o", str(exe), *inc, f"-L{a.lib}", "-lllama",
           f"-Wl,-rpath,{a.lib}"]  # fmt: skip
    subprocess.run(cmd, check=True)
    return exe


def run(a) -> None:
    adapters = sorted(str(p) for p in Path(a.dir).glob("lora-*.gguf"))
    if len(adapters) < max(CASES.values()):
        raise SystemExit(f"{a.dir}: needs lora-0..3.gguf (`make` writes them)")
    rows: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        exe = _build(a, Path(d))
        for r in range(a.rounds):
            for case, n in CASES.items():
                for engine, fn in (("localllm", lambda x: _ours(a, x)),
                                   ("llama.cpp", lambda x: _theirs(a, exe, x))):  # fmt: skip
                    ts = fn(adapters[:n])
                    rows.setdefault((engine, case), []).extend(ts)
                    print(f"round {r + 1} {engine} {case}: {statistics.fmean(ts):.2f} t/s",
                          file=sys.stderr)  # fmt: skip
    n_runs = len(rows[("localllm", "base")])
    print(f"| engine | case | tg{a.n_gen} t/s (median of {n_runs}) | range | overhead |")
    print("| --- | --- | ---: | ---: | ---: |")
    for engine in ("localllm", "llama.cpp"):
        base = statistics.median(rows[(engine, "base")])
        for case in CASES:
            ts = rows[(engine, case)]
            med = statistics.median(ts)
            print(f"| {engine} | {case} | {med:.2f} | {min(ts):.2f}-{max(ts):.2f} | "
                  f"{100 * (base / med - 1):+.1f} % |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--base", type=Path, required=True, help="Hugging Face base folder")
    m.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree (converter)")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--rank", type=int, default=RANK)
    m.add_argument("--count", type=int, default=4)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True, help="the base GGUF")
    r.add_argument("--dir", required=True, help="`make`'s output (lora-K.gguf)")
    r.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree (headers)")
    r.add_argument("--lib", type=Path, required=True, help="folder with its built libllama.so")
    r.add_argument("-n", "--n-gen", type=int, default=64)
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("-t", "--threads", type=int, default=2)
    r.add_argument("--device", default="cpu")
    a = ap.parse_args()
    {"make": make, "run": run}[a.cmd](a)


if __name__ == "__main__":
    main()
